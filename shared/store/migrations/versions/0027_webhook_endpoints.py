"""webhook endpoints: an org's URLs that are sent signed events

Each row is one endpoint of an org: its URL, the event types it is sent (comma-separated),
its signing secret sealed with the deployment's secret key, and when it was made and
removed (``disabled_at``: kept, sent nothing more). Events owed to an endpoint are rows of
the outcome outbox (sink ``webhook``), written with the transition that caused them.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-07 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("events", sa.String(length=255), nullable=False),
        sa.Column("secret_sealed", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_webhook_endpoints_org", "webhook_endpoints", ["org_id"])


def downgrade() -> None:
    op.drop_index("ix_webhook_endpoints_org", table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
