"""expiry and reasons: an item's own expiry, a pool's unserved-queue TTL, a sandbox's end log

- ``work_items.expires_at``: the message's own ``expires_at``; an item not final by then
  fails as ``expired`` (indexed where set: the rule reads only items that carry one).
- ``pools.routed_ttl_s``: how long an item may stay routed to this pool's queue while no
  worker consumes it before it fails as ``no_worker``; null: the deployment's
  ``CORRAL_ROUTED_TTL_S``.
- ``sandboxes.end_log``: the provider's own log of a sandbox that ended before its runner
  reported (bounded, redacted, the last lines), kept on the attempt.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-08 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

_EXPIRING = sa.text("expires_at IS NOT NULL")


def upgrade() -> None:
    op.add_column("work_items", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_work_items_expires",
        "work_items",
        ["expires_at"],
        postgresql_where=_EXPIRING,
        sqlite_where=_EXPIRING,
    )
    op.add_column("pools", sa.Column("routed_ttl_s", sa.Integer(), nullable=True))
    op.add_column("sandboxes", sa.Column("end_log", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("sandboxes", "end_log")
    op.drop_column("pools", "routed_ttl_s")
    op.drop_index("ix_work_items_expires", table_name="work_items")
    op.drop_column("work_items", "expires_at")
