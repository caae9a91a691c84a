"""named secrets and their uses

- ``named_secrets``: a secret kept by name, an org's or the deployment's (``org_id`` ``*``),
  its value sealed (bound to the org and the name); one per org and name.
- ``secret_uses``: one row per resolution of a named secret for a work item (the secret's
  name and scope, env or binding, the variable or binding name, when), never a value;
  indexed by item.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-10 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "named_secrets",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("sealed", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("org_id", "name", name="uq_named_secrets_org_name"),
    )
    op.create_table(
        "secret_uses",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("secret_name", sa.String(length=63), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("used_in", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_secret_uses_item", "secret_uses", ["work_item_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_secret_uses_item", table_name="secret_uses")
    op.drop_table("secret_uses")
    op.drop_table("named_secrets")
