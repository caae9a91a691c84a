"""who set a budget, what it does at its cap, its warnings; the queues' consumers

A budget records who set it (``set_by``: ``deployment``, as every existing one was, or
``org``): one per org or pool, period and owner, the deployment's and the org's applying side
by side. ``on_cap`` says what a spent budget does (``refuse`` new work, as before, or also
``stop`` the running sandboxes); ``thresholds`` (null: 50, 80, 100 %) are warned of once per
period, ``warned_pct`` and ``warned_period_start`` saying which was last. Where two budgets of
the same scope were stored (no uniqueness held them apart before), the strictest is kept: it
was the one routing enforced.

``queue_consumers`` holds when each process consuming a queue last said so; the api's metrics
count them.

Revision ID: 0024
Revises: 0022
Create Date: 2026-11-29 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0022"
branch_labels = None
depends_on = None

ORG_WIDE = sa.text("pool_id IS NULL")
OF_POOL = sa.text("pool_id IS NOT NULL")

# A budget with a stricter twin of the same scope (a lower cap, or the same cap and a
# lower id) goes; NULL pools are the same scope, hence the COALESCE.
_LOOSER_TWINS = """
DELETE FROM budgets WHERE EXISTS (
    SELECT 1 FROM budgets AS twin
    WHERE twin.org_id = budgets.org_id
      AND COALESCE(twin.pool_id, '') = COALESCE(budgets.pool_id, '')
      AND twin.period = budgets.period
      AND (twin.cap_micros < budgets.cap_micros
           OR (twin.cap_micros = budgets.cap_micros AND twin.id < budgets.id))
)
"""


def upgrade() -> None:
    op.add_column(
        "budgets",
        sa.Column("set_by", sa.String(length=16), server_default="deployment", nullable=False),
    )
    op.add_column(
        "budgets",
        sa.Column("on_cap", sa.String(length=16), server_default="refuse", nullable=False),
    )
    op.add_column("budgets", sa.Column("thresholds", sa.JSON(), nullable=True))
    op.add_column("budgets", sa.Column("warned_pct", sa.Integer(), nullable=True))
    op.add_column(
        "budgets", sa.Column("warned_period_start", sa.DateTime(timezone=True), nullable=True)
    )
    op.execute(_LOOSER_TWINS)
    op.create_index(
        "ux_budgets_org_scope",
        "budgets",
        ["org_id", "period", "set_by"],
        unique=True,
        postgresql_where=ORG_WIDE,
        sqlite_where=ORG_WIDE,
    )
    op.create_index(
        "ux_budgets_pool_scope",
        "budgets",
        ["pool_id", "period", "set_by"],
        unique=True,
        postgresql_where=OF_POOL,
        sqlite_where=OF_POOL,
    )
    op.create_table(
        "queue_consumers",
        sa.Column("queue", sa.String(length=255), nullable=False),
        sa.Column("consumer_id", sa.String(length=255), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("queue", "consumer_id"),
    )


def downgrade() -> None:
    op.drop_table("queue_consumers")
    op.drop_index("ux_budgets_pool_scope", table_name="budgets")
    op.drop_index("ux_budgets_org_scope", table_name="budgets")
    for column in ("warned_period_start", "warned_pct", "thresholds", "on_cap", "set_by"):
        op.drop_column("budgets", column)
