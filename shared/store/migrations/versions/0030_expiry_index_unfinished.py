"""the expiry rule's index covers the unfinished items alone

``ix_work_items_expires`` held every item that ever carried an ``expires_at``, ended ones
too, so the expiry rule's range read grew with history; it now holds the items not yet
finished (``finished_at`` is set by every final state), which the rule asks for.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-09 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

_EXPIRING = sa.text("expires_at IS NOT NULL")
_EXPIRING_UNFINISHED = sa.text("expires_at IS NOT NULL AND finished_at IS NULL")


def _replace(where: sa.TextClause) -> None:
    op.drop_index("ix_work_items_expires", table_name="work_items")
    op.create_index(
        "ix_work_items_expires",
        "work_items",
        ["expires_at"],
        postgresql_where=where,
        sqlite_where=where,
    )


def upgrade() -> None:
    _replace(_EXPIRING_UNFINISHED)


def downgrade() -> None:
    _replace(_EXPIRING)
