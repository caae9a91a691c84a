"""shared capacity: capacities several orgs' pools draw on, each pool's share, org weights;
an index of each project's waiting items (an org's projects take turns)

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-13 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None

_WAITING = sa.text("state = 'waiting_capacity'")


def upgrade() -> None:
    op.create_table(
        "capacities",
        sa.Column("id", sa.String(63), primary_key=True),
        sa.Column("name", sa.String(63), nullable=False, unique=True),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "org_weights",
        sa.Column("org_id", sa.String(63), primary_key=True),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("capacity_id", sa.String(63), nullable=True))
        batch.add_column(sa.Column("share_limit", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_pools_capacity_id", "capacities", ["capacity_id"], ["id"])
        batch.create_index("ix_pools_capacity", ["capacity_id"])
    op.create_index(
        "ix_work_items_waiting_project",
        "work_items",
        ["org_id", "project_id", "queue_key"],
        postgresql_where=_WAITING,
        sqlite_where=_WAITING,
    )


def downgrade() -> None:
    op.drop_index("ix_work_items_waiting_project", table_name="work_items")
    with op.batch_alter_table("pools") as batch:
        batch.drop_index("ix_pools_capacity")
        batch.drop_constraint("fk_pools_capacity_id", type_="foreignkey")
        batch.drop_column("share_limit")
        batch.drop_column("capacity_id")
    op.drop_table("org_weights")
    op.drop_table("capacities")
