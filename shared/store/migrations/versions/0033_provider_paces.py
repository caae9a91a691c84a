"""provider pacing: one row per provider credential, shared by every worker process

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-12 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "provider_paces",
        sa.Column("key", sa.String(96), primary_key=True),
        sa.Column("provider_id", sa.String(63), nullable=False),
        sa.Column("tat", sa.Float(), nullable=False),
        sa.Column("rate", sa.Float(), nullable=True),
        sa.Column("slowed_at", sa.Float(), nullable=True),
        sa.Column("in_flight", sa.JSON(), nullable=False),
        sa.Column("reserved", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("provider_paces")
