"""a version of the routing configuration, bumped by every change routing reads

The scheduler keeps the configuration it routes by (the orgs' pools, the profiles' auth
modes, which orgs have a limit) between batches, and a batch it routed on what it kept is
written only while this version is still the one it read (corral.scheduler.routing_cache).
On PostgreSQL, triggers bump the version with every change of a pool's routing columns
(not its slot counter), every pool added or removed, and every change of a model profile or
an org limit. They are deferred to the commit: the version row is locked from the moment a
transaction commits until it has, and never before another lock, so it cannot deadlock.

SQLite has the table and no triggers: it routes without the kept configuration.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-24 18:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# What routing reads of a pool, but its slot counter (corral.shared.pools.ROUTING_COLUMNS,
# and `active`, which the read filters on). JSON columns are compared as text: json has no
# equality. A test keeps this list and ROUTING_COLUMNS together.
POOL_ROUTING_COLUMNS = (
    "id",
    "name",
    "org_id",
    "provider_id",
    "priority",
    "active",
    "max_concurrent",
    "runtime_provides::text",
    "capabilities::text",
    "breaker_state",
    "breaker_opened_at",
    "breaker_probe_at",
    "lease::text",
)


def _row(alias: str) -> str:
    return "(" + ", ".join(f"{alias}.{column}" for column in POOL_ROUTING_COLUMNS) + ")"


def upgrade() -> None:
    op.create_table(
        "routing_config_version",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    if op.get_bind().dialect.name != "postgresql":
        op.execute("INSERT INTO routing_config_version (id, version) VALUES (1, 1)")
        return
    # Versions count from the clock, in microseconds: a database made again never starts
    # at a version a running process still keeps.
    op.execute(
        """
        CREATE FUNCTION corral_routing_clock() RETURNS bigint LANGUAGE sql VOLATILE AS $$
            SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
        $$
        """
    )
    op.execute("INSERT INTO routing_config_version VALUES (1, corral_routing_clock())")
    op.execute(
        """
        CREATE FUNCTION corral_routing_config_changed() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            -- Never below the clock: a database restored to an older version (a dump, a
            -- point in time, a replica that lost its last commits) moves past every
            -- version a running process may keep at its next change.
            UPDATE routing_config_version
               SET version = greatest(version + 1, corral_routing_clock())
             WHERE id = 1;
            RETURN NULL;
        END
        $$
        """
    )
    deferred = "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
    bump = "EXECUTE FUNCTION corral_routing_config_changed()"
    for table in ("model_profiles", "org_limits"):
        op.execute(
            f"CREATE CONSTRAINT TRIGGER {table}_routing_config AFTER INSERT OR UPDATE OR "
            f"DELETE ON {table} {deferred} {bump}"
        )
    op.execute(
        f"CREATE CONSTRAINT TRIGGER pools_routing_config_rows AFTER INSERT OR DELETE ON pools "
        f"{deferred} {bump}"
    )
    op.execute(
        f"CREATE CONSTRAINT TRIGGER pools_routing_config AFTER UPDATE ON pools {deferred} "
        f"WHEN ({_row('OLD')} IS DISTINCT FROM {_row('NEW')}) {bump}"
    )
    for table in ("model_profiles", "org_limits", "pools"):
        op.execute(
            f"CREATE TRIGGER {table}_routing_config_truncate AFTER TRUNCATE ON {table} "
            f"FOR EACH STATEMENT {bump}"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in ("model_profiles", "org_limits", "pools"):
            op.execute(f"DROP TRIGGER IF EXISTS {table}_routing_config_truncate ON {table}")
        for table in ("model_profiles", "org_limits"):
            op.execute(f"DROP TRIGGER IF EXISTS {table}_routing_config ON {table}")
        op.execute("DROP TRIGGER IF EXISTS pools_routing_config_rows ON pools")
        op.execute("DROP TRIGGER IF EXISTS pools_routing_config ON pools")
        op.execute("DROP FUNCTION IF EXISTS corral_routing_config_changed()")
        op.execute("DROP FUNCTION IF EXISTS corral_routing_clock()")
    op.drop_table("routing_config_version")
