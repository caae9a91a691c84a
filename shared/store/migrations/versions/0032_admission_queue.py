"""admission: a waiting item's place, what holds it and the pools it waits for

``queue_key`` orders an org's waiting items (when each began waiting, less its priority's
head start), ``wait_reason`` and ``wait_pools`` say what holds it; the partial index holds
the waiting items alone, by org in that order, so the re-drive reads the first few of an org
with room whatever waits behind them, and a waiting item's place is an index range count.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-10 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

_WAITING = sa.text("state = 'waiting_capacity'")


def upgrade() -> None:
    op.add_column("work_items", sa.Column("queue_key", sa.DateTime(timezone=True), nullable=True))
    op.add_column("work_items", sa.Column("wait_reason", sa.String(32), nullable=True))
    op.add_column("work_items", sa.Column("wait_pools", sa.JSON(), nullable=True))
    # Items already waiting keep the order they had (the re-drive's: updated_at).
    op.execute("UPDATE work_items SET queue_key = updated_at WHERE state = 'waiting_capacity'")
    op.create_index(
        "ix_work_items_waiting_queue",
        "work_items",
        ["org_id", "queue_key"],
        postgresql_where=_WAITING,
        sqlite_where=_WAITING,
    )


def downgrade() -> None:
    op.drop_index("ix_work_items_waiting_queue", table_name="work_items")
    with op.batch_alter_table("work_items") as table:  # SQLite drops columns by copying
        table.drop_column("wait_pools")
        table.drop_column("wait_reason")
        table.drop_column("queue_key")
