"""Process-wide settings, read from ``CORRAL_*`` environment variables.

Precedence everywhere: an explicit argument beats a setting, and a setting beats the
default declared here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "corral"


class CoreSettings(BaseSettings):
    """Settings every corral component shares."""

    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="ignore", frozen=True)

    state_dir: Path = Field(
        default_factory=_default_state_dir,
        description="Where corral keeps local state (the embedded database, local sandboxes).",
    )
    secret_key: SecretStr | None = Field(
        default=None,
        description="Key that encrypts stored provider credentials. Required to store or "
        "read an org's credential; generate one with `corral secret-key`.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the system of record; defaults to SQLite in state_dir.",
    )

    def resolved_database_url(self) -> str:
        """The database URL, falling back to the embedded SQLite file."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.state_dir / 'corral.db'}"
