"""outcomes owed to senders: an item's Celery task id and replies, the outcome outbox

A work item keeps the Celery task id of the message that made it (indexed: the item of a
task id, and the task id of an item) and the replies its end owes (``replies``: each a task
id with the message's link and link_error callbacks; null when no result backend was
configured). The transaction that ends an item writes one ``outcome_outbox`` row per reply;
the maintenance worker delivers each (the final record stored under the task id in the
result backend, the callbacks sent) and deletes it, or keeps it as failed once given up.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-30 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_UNDELIVERED = sa.text("failed_at IS NULL")


def upgrade() -> None:
    op.add_column("work_items", sa.Column("task_id", sa.String(length=255), nullable=True))
    op.add_column("work_items", sa.Column("replies", sa.JSON(), nullable=True))
    op.create_index("ix_work_items_task_id", "work_items", ["task_id"])
    op.create_table(
        "outcome_outbox",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("sink", sa.String(length=32), nullable=False),
        sa.Column("target", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["work_item_id"], ["work_items.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_outcome_outbox_due",
        "outcome_outbox",
        ["due_at"],
        postgresql_where=_UNDELIVERED,
        sqlite_where=_UNDELIVERED,
    )
    op.create_index("ix_outcome_outbox_item", "outcome_outbox", ["work_item_id"])


def downgrade() -> None:
    op.drop_index("ix_outcome_outbox_item", table_name="outcome_outbox")
    op.drop_index("ix_outcome_outbox_due", table_name="outcome_outbox")
    op.drop_table("outcome_outbox")
    op.drop_index("ix_work_items_task_id", table_name="work_items")
    op.drop_column("work_items", "replies")
    op.drop_column("work_items", "task_id")
