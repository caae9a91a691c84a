"""which try of which provision task holds a sandbox's lease

A provision task whose claim committed but whose answer was lost (its connection dropped
at that instant) is retried; the retry found the attempt under a live lease and waited it
out (CORRAL_PROVISION_LEASE_S). The claim now notes its holder, so that a later try of the
same task takes the lease over at once.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-24 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sandboxes", sa.Column("lease_holder", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("sandboxes", "lease_holder")
