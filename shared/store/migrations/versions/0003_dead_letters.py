"""dead letters

Broker messages that could not be read as a task: their queue, reason, size and digest.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 23:59:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("queue", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("task_name", sa.String(length=255), nullable=True),
        sa.Column("task_id", sa.String(length=255), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_dead_letters_received", "dead_letters", ["received_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_dead_letters_received", table_name="dead_letters")
    op.drop_table("dead_letters")
