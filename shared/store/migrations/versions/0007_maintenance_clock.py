"""the reaper's phase clock in the database

The sweep lock is a PostgreSQL advisory lock on every broker; when each less frequent phase
(reconcile) last ran is a row here, shared by every maintenance worker.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 08:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "maintenance_clock",
        sa.Column("phase", sa.String(length=64), nullable=False),
        sa.Column("last_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("phase"),
    )


def downgrade() -> None:
    op.drop_table("maintenance_clock")
