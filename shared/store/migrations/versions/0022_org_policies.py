"""what the deployment decides for an org: the images and regions its work may use, and each
pool's max_concurrent ceiling

An org admin key may change a pool's name, active flag, priority and max_concurrent up to
the pool's ceiling, which only the deployment sets (existing pools: their max_concurrent).
``org_policies`` holds, per org, the image patterns its items may name and the regions they
may ask for (none: the deployment's defaults). Routing reads them, so on PostgreSQL a change
bumps the routing configuration's version (migration 0018).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29 08:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("max_concurrent_ceiling", sa.Integer(), nullable=True))
    op.execute("UPDATE pools SET max_concurrent_ceiling = max_concurrent")
    op.create_table(
        "org_policies",
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("item_images", sa.JSON(), nullable=True),
        sa.Column("regions", sa.JSON(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("org_id"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE CONSTRAINT TRIGGER org_policies_routing_config AFTER INSERT OR UPDATE OR "
            "DELETE ON org_policies DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            "EXECUTE FUNCTION corral_routing_config_changed()"
        )
        op.execute(
            "CREATE TRIGGER org_policies_routing_config_truncate AFTER TRUNCATE ON "
            "org_policies FOR EACH STATEMENT EXECUTE FUNCTION corral_routing_config_changed()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS org_policies_routing_config_truncate ON org_policies")
        op.execute("DROP TRIGGER IF EXISTS org_policies_routing_config ON org_policies")
    op.drop_table("org_policies")
    op.drop_column("pools", "max_concurrent_ceiling")
