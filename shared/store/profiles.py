"""A model profile as the work sees it: the environment variables that carry it into the
sandbox.

A profile names a model and the auth mode of its credentials; the deployment admin makes
them (`corral profiles create`), an org key cannot. An item names one in its message's
``profile`` (``default`` when it names none), routing holds a ``local`` or ``host-session``
auth mode to local pools, and the work gets the model in ``CORRAL_MODEL``, the profile's
name in ``CORRAL_PROFILE`` and its auth mode in ``CORRAL_AUTH_MODE`` (docs/dispatch.md), by
the runner's claim or, for a code interpreter, as the worker runs the code.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from corral.shared.store.models import ModelProfile

DEFAULT_PROFILE = "default"  # what an item that names no profile gets
MODEL_ENV = "CORRAL_MODEL"
PROFILE_ENV = "CORRAL_PROFILE"
AUTH_MODE_ENV = "CORRAL_AUTH_MODE"


@dataclass(frozen=True)
class Profile:
    """A profile as an item's work gets it."""

    name: str
    model: str
    auth_mode: str

    def env(self) -> dict[str, str]:
        """The work's variables that carry it (corral's own names, which no message sets)."""
        return {MODEL_ENV: self.model, PROFILE_ENV: self.name, AUTH_MODE_ENV: self.auth_mode}


def read_profile(session: Session, name: str | None) -> Profile | None:
    """The profile ``name`` as it is now; None: an item of none (older rows) or one gone."""
    row = session.get(ModelProfile, name) if name else None
    return Profile(row.name, row.model, row.auth_mode) if row is not None else None


def profile_env(session: Session, name: str | None) -> dict[str, str]:
    """The variables that carry the profile ``name`` into the work (none without one)."""
    profile = read_profile(session, name)
    return profile.env() if profile is not None else {}
