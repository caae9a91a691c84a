"""the console's sessions, held server-side

The console's cookie carries a random session id and nothing else; ``console_sessions``
keeps its SHA-256, its principal (an org key by id with its org, or the deployment admin
bound to its admin token by an HMAC keyed with the session id), when it was created, expires
and was last seen, and when it was revoked (logging out). Sessions of the old cookie, which
sealed the token's digest, are not carried over: everyone logs in again.

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-30 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.String(length=63), nullable=True),
        sa.Column("org_id", sa.String(length=63), nullable=True),
        sa.Column("admin_check", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id_hash"),
    )
    op.create_index("ix_console_sessions_expires", "console_sessions", ["expires_at"])
    op.create_index("ix_console_sessions_key", "console_sessions", ["api_key_id"])


def downgrade() -> None:
    op.drop_index("ix_console_sessions_key", table_name="console_sessions")
    op.drop_index("ix_console_sessions_expires", table_name="console_sessions")
    op.drop_table("console_sessions")
