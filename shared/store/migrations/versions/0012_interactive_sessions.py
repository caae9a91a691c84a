"""interactive sessions

A live sandbox a caller runs commands in and moves files to and from: the session's row
(its work item, its idle and total TTLs), with partial indexes for the reaper's two rules.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-23 11:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_LIVE = sa.text("ended_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "interactive_sessions",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.String(length=63), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=True),
        sa.Column("idle_ttl_s", sa.Integer(), nullable=False),
        sa.Column("ttl_s", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("idle_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(["work_item_id"], ["work_items.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("work_item_id"),
    )
    for name, column in (
        ("ix_interactive_sessions_live_idle", "idle_until"),
        ("ix_interactive_sessions_live_expires", "expires_at"),
    ):
        op.create_index(
            name,
            "interactive_sessions",
            [column],
            postgresql_where=_LIVE,
            sqlite_where=_LIVE,
        )


def downgrade() -> None:
    op.drop_index("ix_interactive_sessions_live_expires", table_name="interactive_sessions")
    op.drop_index("ix_interactive_sessions_live_idle", table_name="interactive_sessions")
    op.drop_table("interactive_sessions")
