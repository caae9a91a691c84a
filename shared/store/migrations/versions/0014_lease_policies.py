"""lease policies of work items and pools

A pool's default lease policy, the policy in force for each work item, and when a requeued
item may be routed again (its back-off).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-23 11:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("lease", sa.JSON(), nullable=True))
    op.add_column("work_items", sa.Column("lease", sa.JSON(), nullable=True))
    op.add_column("work_items", sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("work_items", "not_before")
    op.drop_column("work_items", "lease")
    op.drop_column("pools", "lease")
