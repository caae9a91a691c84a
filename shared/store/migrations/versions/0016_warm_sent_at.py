"""when a warm sandbox's provision task was sent

Beat's warm tick sends a new warm row's provision task after the commit that wrote it, and
notes it here; a booting row no provider worker took whose task was never noted as sent (the
tick failed after its commit, or died before sending) gets its task from the next tick
(docs/warm-pools.md).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-24 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("warm_sandboxes", sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("warm_sandboxes") as batch:
        batch.drop_column("sent_at")
