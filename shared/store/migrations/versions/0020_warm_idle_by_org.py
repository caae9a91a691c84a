"""indexes of the warm sandboxes by org and the end of their billed idle time

A budget's spend and a cost report since a time add up the idle time of the warm sandboxes
billed since then: bound since, or ended unbound since. That read went through every warm
sandbox the org ever had (warm_sandboxes keeps them all). Two partial indexes, one per
way a warm sandbox's idle time ends, make it read the period's rows.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-24 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

BOUND_AT = sa.text("bound_at IS NOT NULL")
ENDED_UNBOUND = sa.text("bound_at IS NULL AND ended_at IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_warm_sandboxes_org_bound",
        "warm_sandboxes",
        ["org_id", "bound_at"],
        unique=False,
        postgresql_where=BOUND_AT,
        sqlite_where=BOUND_AT,
    )
    op.create_index(
        "ix_warm_sandboxes_org_ended_unbound",
        "warm_sandboxes",
        ["org_id", "ended_at"],
        unique=False,
        postgresql_where=ENDED_UNBOUND,
        sqlite_where=ENDED_UNBOUND,
    )


def downgrade() -> None:
    op.drop_index("ix_warm_sandboxes_org_ended_unbound", table_name="warm_sandboxes")
    op.drop_index("ix_warm_sandboxes_org_bound", table_name="warm_sandboxes")
