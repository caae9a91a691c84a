"""a pool's slots in use as a counter

Routing takes a slot with one guarded update of this counter instead of counting the
pool's work items; it starts at the real count.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 00:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "pools", sa.Column("slots_in_use", sa.Integer(), server_default="0", nullable=False)
    )
    op.execute(
        "UPDATE pools SET slots_in_use = (SELECT count(*) FROM work_items "
        "WHERE work_items.pool_id = pools.id AND work_items.state IN "
        "('routed', 'provisioning', 'awaiting_claim', 'running'))"
    )


def downgrade() -> None:
    op.drop_column("pools", "slots_in_use")
