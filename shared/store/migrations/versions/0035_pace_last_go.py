"""provider paces: when the last create went, so that creates back late together do not go
at once

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-14 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("provider_paces") as batch:
        batch.add_column(sa.Column("last_go", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("provider_paces") as batch:
        batch.drop_column("last_go")
