"""log budget

What each work item's runner logged so far (bytes, lines) and the lines dropped past the
per-item log budget.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = ("log_bytes", "log_lines", "log_dropped_lines")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column(
            "work_items", sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("work_items") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
