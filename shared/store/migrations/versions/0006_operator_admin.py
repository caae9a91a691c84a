"""operator administration: deleted pools, stored provider configuration

A deleted pool keeps its row (its work items, sandboxes and cost events refer to it) with
``deleted_at`` set; the deployment's provider configuration is stored per provider, so an
operator changes it without restarting workers.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 08:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "provider_configs",
        sa.Column("provider_id", sa.String(length=63), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("provider_id"),
    )


def downgrade() -> None:
    op.drop_table("provider_configs")
    op.drop_column("pools", "deleted_at")
