"""webhook events without a work item, and the webhook delivery log

- ``outcome_outbox.work_item_id`` may be null: a budget's crossed threshold is owed by no
  item. ``outcome_outbox.org_id`` says whose outcome a row is (filled in from the rows'
  items for those already there).
- ``webhook_deliveries``: one row per try at delivering a webhook event (its endpoint,
  event id and type, item, try number, the HTTP status or the error, when), with the
  outbox row it was of and that row's target, which a redelivery by hand owes again.
  Indexed for an endpoint's log (newest first), an event's tries, and the pruning of old
  rows.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-09 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_UNDELIVERED = sa.text("failed_at IS NULL")


def _outbox_indexes(create: bool) -> None:
    # Dropped around the batch (SQLite copies the table) and made again as 0026 made them.
    if not create:
        op.drop_index("ix_outcome_outbox_item", table_name="outcome_outbox")
        op.drop_index("ix_outcome_outbox_due", table_name="outcome_outbox")
        return
    op.create_index(
        "ix_outcome_outbox_due",
        "outcome_outbox",
        ["due_at"],
        postgresql_where=_UNDELIVERED,
        sqlite_where=_UNDELIVERED,
    )
    op.create_index("ix_outcome_outbox_item", "outcome_outbox", ["work_item_id"])


def upgrade() -> None:
    _outbox_indexes(create=False)
    with op.batch_alter_table("outcome_outbox") as batch:
        batch.add_column(sa.Column("org_id", sa.String(length=63), nullable=True))
    op.execute(
        "UPDATE outcome_outbox SET org_id = "
        "(SELECT org_id FROM work_items WHERE work_items.id = outcome_outbox.work_item_id)"
    )
    with op.batch_alter_table("outcome_outbox") as batch:
        batch.alter_column("org_id", existing_type=sa.String(length=63), nullable=False)
        batch.alter_column("work_item_id", existing_type=sa.String(length=63), nullable=True)
    _outbox_indexes(create=True)
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("endpoint_id", sa.String(length=63), nullable=False),
        sa.Column("org_id", sa.String(length=63), nullable=False),
        sa.Column("event_id", sa.String(length=63), nullable=False),
        sa.Column("event_type", sa.String(length=32), nullable=False),
        sa.Column("work_item_id", sa.String(length=63), nullable=True),
        sa.Column("outbox_id", sa.BigInteger(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_webhook_deliveries_endpoint", "webhook_deliveries", ["endpoint_id", "id"])
    op.create_index("ix_webhook_deliveries_event", "webhook_deliveries", ["event_id"])
    op.create_index("ix_webhook_deliveries_at", "webhook_deliveries", ["at"])


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_at", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_event", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_endpoint", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    # What no item owes has nowhere to go in the older schema.
    op.execute("DELETE FROM outcome_outbox WHERE work_item_id IS NULL")
    _outbox_indexes(create=False)
    with op.batch_alter_table("outcome_outbox") as batch:
        batch.alter_column("work_item_id", existing_type=sa.String(length=63), nullable=False)
        batch.drop_column("org_id")
    _outbox_indexes(create=True)
