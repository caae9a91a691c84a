"""an index of the bound warm sandboxes by their item's sandbox

The reaper looks up the warm sandbox each of a sweep's sandboxes was bound from, and a
takeover the warm sandboxes bound to the attempt it takes over: both read every row of
warm_sandboxes, a table that keeps each warm sandbox ever made. A partial index of the
bound ones by sandbox makes those reads grow with the rows they want.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-24 20:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

BOUND_TO = sa.text("sandbox_id IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_warm_sandboxes_sandbox",
        "warm_sandboxes",
        ["sandbox_id"],
        unique=False,
        postgresql_where=BOUND_TO,
        sqlite_where=BOUND_TO,
    )


def downgrade() -> None:
    op.drop_index("ix_warm_sandboxes_sandbox", table_name="warm_sandboxes")
