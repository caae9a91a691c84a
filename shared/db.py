"""The system of record: SQLAlchemy 2.0 models and engine set-up.

PostgreSQL in production, SQLite for the embedded default. Tables are added here as the
components that own them are built; schema changes ship as Alembic migrations.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import DateTime, Engine, LargeBinary, String, UniqueConstraint, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from shared.settings import CoreSettings


class Base(DeclarativeBase):
    pass


def _now() -> datetime:
    return datetime.now(UTC)


class ProviderCredential(Base):
    """An org's credential for one provider, encrypted with the deployment's secret key."""

    __tablename__ = "provider_credentials"
    __table_args__ = (UniqueConstraint("org_id", "provider_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    org_id: Mapped[str] = mapped_column(String(63))
    provider_id: Mapped[str] = mapped_column(String(63))
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


def make_engine(url: str | None = None) -> Engine:
    """An engine for ``url``, else for the configured database (SQLite by default)."""
    resolved = url or CoreSettings().resolved_database_url()
    if resolved.startswith("sqlite:///"):
        Path(resolved.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return create_engine(resolved, pool_pre_ping=True)
