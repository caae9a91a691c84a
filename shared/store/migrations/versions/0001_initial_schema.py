"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-21 20:01:15.202179
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _create_lifecycle_events()
    _create_profiles_pools_and_credentials()
    _create_work_items()
    _create_sandboxes()
    _create_work_item_logs()
    _create_cost_events()
    _create_runner_tokens_and_sessions()


def _create_lifecycle_events() -> None:
    op.create_table(
        "lifecycle_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("entity", sa.String(length=32), nullable=False),
        sa.Column("entity_id", sa.String(length=63), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=True),
        sa.Column("from_state", sa.String(length=32), nullable=True),
        sa.Column("to_state", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("lifecycle_events", schema=None) as batch_op:
        batch_op.create_index("ix_lifecycle_events_item", ["work_item_id", "id"], unique=False)


def _create_profiles_pools_and_credentials() -> None:
    op.create_table(
        "model_profiles",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("auth_mode", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "pools",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("provider_id", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=False),
        sa.Column("runtime_provides", sa.JSON(), nullable=True),
        sa.Column("capabilities", sa.JSON(), nullable=True),
        sa.Column("sandbox_config", sa.JSON(), nullable=False),
        sa.Column("billing_model", sa.String(length=32), nullable=True),
        sa.Column("rate_micros", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("org_id", "name"),
    )
    with op.batch_alter_table("pools", schema=None) as batch_op:
        batch_op.create_index("ix_pools_org_active", ["org_id", "active", "priority"], unique=False)

    op.create_table(
        "provider_credentials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("provider_id", sa.String(length=63), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("org_id", "provider_id"),
    )


def _create_work_items() -> None:
    op.create_table(
        "work_items",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.String(length=63), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("profile", sa.String(length=63), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("pool_id", sa.String(length=63), nullable=True),
        sa.Column("queue", sa.String(length=255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("routed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("provisioned_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["pool_id"],
            ["pools.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("org_id", "idempotency_key", name="uq_work_items_idempotency"),
    )
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.create_index("ix_work_items_pool_state", ["pool_id", "state"], unique=False)
        batch_op.create_index("ix_work_items_state_updated", ["state", "updated_at"], unique=False)


def _create_sandboxes() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("pool_id", sa.String(length=63), nullable=False),
        sa.Column("provider_id", sa.String(length=63), nullable=False),
        sa.Column("external_id", sa.String(length=255), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("terminated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("termination_reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["pool_id"],
            ["pools.id"],
        ),
        sa.ForeignKeyConstraint(
            ["work_item_id"],
            ["work_items.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("work_item_id", "attempt", name="uq_sandboxes_item_attempt"),
    )
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.create_index("ix_sandboxes_status", ["status"], unique=False)


def _create_work_item_logs() -> None:
    op.create_table(
        "work_item_logs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("stream", sa.String(length=16), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.Column("logged_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["work_item_id"],
            ["work_items.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("work_item_logs", schema=None) as batch_op:
        batch_op.create_index("ix_work_item_logs_item", ["work_item_id", "id"], unique=False)


def _create_cost_events() -> None:
    op.create_table(
        "cost_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("sandbox_id", sa.String(length=63), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("project_id", sa.String(length=63), nullable=False),
        sa.Column("pool_id", sa.String(length=63), nullable=False),
        sa.Column("provider_id", sa.String(length=63), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("billing_model", sa.String(length=32), nullable=False),
        sa.Column("amount_micros", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sandbox_id"],
            ["sandboxes.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sandbox_id"),
    )
    with op.batch_alter_table("cost_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_cost_events_org_id"), ["org_id"], unique=False)


def _create_runner_tokens_and_sessions() -> None:
    op.create_table(
        "registration_tokens",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("sandbox_id", sa.String(length=63), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("redeemed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sandbox_id"],
            ["sandboxes.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    with op.batch_alter_table("registration_tokens", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_registration_tokens_sandbox_id"), ["sandbox_id"], unique=False
        )

    op.create_table(
        "runner_sessions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("session_hash", sa.String(length=64), nullable=False),
        sa.Column("sandbox_id", sa.String(length=63), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sandbox_id"],
            ["sandboxes.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("session_hash"),
    )
    with op.batch_alter_table("runner_sessions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_runner_sessions_sandbox_id"), ["sandbox_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("runner_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runner_sessions_sandbox_id"))

    op.drop_table("runner_sessions")
    with op.batch_alter_table("registration_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_registration_tokens_sandbox_id"))

    op.drop_table("registration_tokens")
    with op.batch_alter_table("cost_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_cost_events_org_id"))

    op.drop_table("cost_events")
    with op.batch_alter_table("work_item_logs", schema=None) as batch_op:
        batch_op.drop_index("ix_work_item_logs_item")

    op.drop_table("work_item_logs")
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.drop_index("ix_sandboxes_status")

    op.drop_table("sandboxes")
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.drop_index("ix_work_items_state_updated")
        batch_op.drop_index("ix_work_items_pool_state")

    op.drop_table("work_items")
    op.drop_table("provider_credentials")
    with op.batch_alter_table("pools", schema=None) as batch_op:
        batch_op.drop_index("ix_pools_org_active")

    op.drop_table("pools")
    op.drop_table("model_profiles")
    with op.batch_alter_table("lifecycle_events", schema=None) as batch_op:
        batch_op.drop_index("ix_lifecycle_events_item")

    op.drop_table("lifecycle_events")
