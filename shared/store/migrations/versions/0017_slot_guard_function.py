"""a function that aborts a batch's write when its pool's slots were taken meanwhile

The intake writes a batch that takes one pool's slots as one statement (its items, their
events and the guarded slot update; corral.scheduler.batch). Run on its own, outside a
transaction, that statement must write nothing when the guard finds the slots gone: this
function, given how many pool rows the guarded update changed, raises SQLSTATE CR001 when
that is none, so the whole statement is undone and the batch routed again.

PostgreSQL only: SQLite writes such a batch in a transaction of several statements.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-24 12:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE OR REPLACE FUNCTION corral_slots_taken(changed bigint, pool text)
        RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
            IF changed = 0 THEN
                RAISE EXCEPTION 'pool % has no free slots left for this batch', pool
                    USING ERRCODE = 'CR001',
                          HINT = 'corral routes the batch again on fresh counters';
            END IF;
            RETURN changed;
        END
        $$
        """
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS corral_slots_taken(bigint, text)")
