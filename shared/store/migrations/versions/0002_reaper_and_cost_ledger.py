"""reaper indexes and the cost ledger

One index per reaper rule (each a range over the stale end only), the ledger's
due marker on sandboxes, and the rate, usage and reason on cost events.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 21:13:52.502259
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "cost_events", sa.Column("rate_micros", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column("cost_events", sa.Column("cpu_seconds", sa.Float(), nullable=True))
    op.add_column(
        "cost_events",
        sa.Column("cpu_estimated", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("cost_events", sa.Column("termination_reason", sa.Text(), nullable=True))
    op.drop_index(op.f("ix_cost_events_org_id"), table_name="cost_events")
    op.create_index(op.f("ix_cost_events_ended_at"), "cost_events", ["ended_at"], unique=False)
    op.create_index("ix_cost_events_org_ended", "cost_events", ["org_id", "ended_at"], unique=False)
    op.add_column(
        "sandboxes", sa.Column("end_requested_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("sandboxes", sa.Column("cost_due_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("sandboxes", sa.Column("cpu_seconds", sa.Float(), nullable=True))
    op.drop_index(op.f("ix_sandboxes_status"), table_name="sandboxes")
    op.create_index(
        "ix_sandboxes_cost_due",
        "sandboxes",
        ["cost_due_at"],
        unique=False,
        postgresql_where=sa.text("cost_due_at IS NOT NULL"),
        sqlite_where=sa.text("cost_due_at IS NOT NULL"),
    )
    op.create_index(
        "ix_sandboxes_live_deadline",
        "sandboxes",
        ["deadline_at"],
        unique=False,
        postgresql_where=sa.text("terminated_at IS NULL"),
        sqlite_where=sa.text("terminated_at IS NULL"),
    )
    op.create_index(
        "ix_sandboxes_live_end_requested",
        "sandboxes",
        ["end_requested_at"],
        unique=False,
        postgresql_where=sa.text("terminated_at IS NULL"),
        sqlite_where=sa.text("terminated_at IS NULL"),
    )
    op.create_index(
        "ix_sandboxes_live_provider",
        "sandboxes",
        ["provider_id"],
        unique=False,
        postgresql_where=sa.text("terminated_at IS NULL"),
        sqlite_where=sa.text("terminated_at IS NULL"),
    )
    op.create_index(
        "ix_sandboxes_status_created", "sandboxes", ["status", "created_at"], unique=False
    )
    op.create_index(
        "ix_sandboxes_status_heartbeat", "sandboxes", ["status", "last_heartbeat_at"], unique=False
    )
    op.create_index(
        "ix_sandboxes_status_started", "sandboxes", ["status", "started_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_sandboxes_status_started", table_name="sandboxes")
    op.drop_index("ix_sandboxes_status_heartbeat", table_name="sandboxes")
    op.drop_index("ix_sandboxes_status_created", table_name="sandboxes")
    op.drop_index(
        "ix_sandboxes_live_provider",
        table_name="sandboxes",
        postgresql_where=sa.text("terminated_at IS NULL"),
        sqlite_where=sa.text("terminated_at IS NULL"),
    )
    op.drop_index(
        "ix_sandboxes_live_end_requested",
        table_name="sandboxes",
        postgresql_where=sa.text("terminated_at IS NULL"),
        sqlite_where=sa.text("terminated_at IS NULL"),
    )
    op.drop_index(
        "ix_sandboxes_live_deadline",
        table_name="sandboxes",
        postgresql_where=sa.text("terminated_at IS NULL"),
        sqlite_where=sa.text("terminated_at IS NULL"),
    )
    op.drop_index(
        "ix_sandboxes_cost_due",
        table_name="sandboxes",
        postgresql_where=sa.text("cost_due_at IS NOT NULL"),
        sqlite_where=sa.text("cost_due_at IS NOT NULL"),
    )
    op.create_index(op.f("ix_sandboxes_status"), "sandboxes", ["status"], unique=False)
    op.drop_index("ix_cost_events_org_ended", table_name="cost_events")
    op.drop_index(op.f("ix_cost_events_ended_at"), table_name="cost_events")
    op.create_index(op.f("ix_cost_events_org_id"), "cost_events", ["org_id"], unique=False)
    with op.batch_alter_table("sandboxes") as batch_op:
        batch_op.drop_column("cpu_seconds")
        batch_op.drop_column("cost_due_at")
        batch_op.drop_column("end_requested_at")
    with op.batch_alter_table("cost_events") as batch_op:
        batch_op.drop_column("termination_reason")
        batch_op.drop_column("cpu_estimated")
        batch_op.drop_column("cpu_seconds")
        batch_op.drop_column("rate_micros")
