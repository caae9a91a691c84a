"""warm pools

Pools may keep warm_min idle sandboxes ready; each is a row of warm_sandboxes until it is
bound to a work item or ends (docs/warm-pools.md).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-23 11:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("warm_min", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(
            sa.Column("warm_idle_ttl_s", sa.Integer(), server_default="600", nullable=False)
        )
        batch.add_column(sa.Column("warm_schedule", sa.JSON(), nullable=True))
    op.create_table(
        "warm_sandboxes",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("pool_id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("provider_id", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("external_id", sa.String(length=255), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("enrol_hash", sa.String(length=64), nullable=True),
        sa.Column("enrolled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("channel_hash", sa.String(length=64), nullable=True),
        sa.Column("config_digest", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("work_item_id", sa.String(length=63), nullable=True),
        sa.Column("sandbox_id", sa.String(length=63), nullable=True),
        sa.Column("bound_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("handed_over_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(length=64), nullable=True),
        sa.Column("idle_seconds", sa.Float(), nullable=True),
        sa.Column("idle_amount_micros", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("channel_hash"),
        sa.UniqueConstraint("enrol_hash"),
    )
    op.create_index(
        "ix_warm_sandboxes_pool_state", "warm_sandboxes", ["pool_id", "state", "created_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_warm_sandboxes_pool_state", table_name="warm_sandboxes")
    op.drop_table("warm_sandboxes")
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("warm_schedule")
        batch.drop_column("warm_idle_ttl_s")
        batch.drop_column("warm_min")
