"""spend caps

A budget caps an org's (or one pool's) spend over a calendar period; routing refuses new
work once the period's spend (billed sandboxes, and what live and unbilled ones have run
up) reaches it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 09:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

LIVE = sa.text("terminated_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("pool_id", sa.String(length=63), nullable=True),
        sa.Column("period", sa.String(length=16), nullable=False),
        sa.Column("cap_micros", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_budgets_org", "budgets", ["org_id"], unique=False)
    op.create_index(
        "ix_sandboxes_live_org",
        "sandboxes",
        ["org_id"],
        unique=False,
        postgresql_where=LIVE,
        sqlite_where=LIVE,
    )


def downgrade() -> None:
    op.drop_index("ix_sandboxes_live_org", table_name="sandboxes")
    op.drop_index("ix_budgets_org", table_name="budgets")
    op.drop_table("budgets")
