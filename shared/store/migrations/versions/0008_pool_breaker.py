"""a circuit breaker per pool

Consecutive provision failures open a pool's breaker: routing skips it until a cool-down
has passed, then lets one probe item through (half open); a success closes it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

COLUMNS = ("breaker_failed_at", "breaker_opened_at", "breaker_probe_at")


def upgrade() -> None:
    op.add_column(
        "pools",
        sa.Column("breaker_state", sa.String(length=16), server_default="closed", nullable=False),
    )
    op.add_column(
        "pools", sa.Column("breaker_failures", sa.Integer(), server_default="0", nullable=False)
    )
    for name in COLUMNS:
        op.add_column("pools", sa.Column(name, sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    for name in ("breaker_state", "breaker_failures", *COLUMNS):
        op.drop_column("pools", name)
