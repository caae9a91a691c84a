"""indexes for the web console

Work items newest first (the console's item list, and its dispatch rate over the last hour)
read an index on ``created_at`` instead of sorting every item.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-23 12:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_work_items_created", "work_items", ["created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_work_items_created", table_name="work_items")
