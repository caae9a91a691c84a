"""org api keys and org-wide concurrency limits

Api keys scoped to one org (dispatch, read, admin), stored as hashes; and an optional
limit on an org's work in flight across all its pools.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23 11:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("scopes", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    op.create_index("ix_api_keys_org", "api_keys", ["org_id"])
    op.create_table(
        "org_limits",
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("org_id"),
    )


def downgrade() -> None:
    op.drop_table("org_limits")
    op.drop_index("ix_api_keys_org", table_name="api_keys")
    op.drop_table("api_keys")
