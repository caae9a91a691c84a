"""Provider credentials kept in the database (ciphertext only; see
:mod:`corral.providers.credentials` for how they are encrypted and resolved)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from corral.shared.store.db import utcnow
from corral.shared.store.models import ProviderCredential


class SqlCredentialStore:
    """Ciphertexts in the ``provider_credentials`` table."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def load(self, org_id: str, provider_id: str) -> bytes | None:
        query = select(ProviderCredential.ciphertext).where(
            ProviderCredential.org_id == org_id, ProviderCredential.provider_id == provider_id
        )
        with self.engine.connect() as connection:
            return connection.execute(query).scalar_one_or_none()

    def save(self, org_id: str, provider_id: str, ciphertext: bytes) -> None:
        with Session(self.engine) as session, session.begin():
            row = session.scalars(
                select(ProviderCredential)
                .where(
                    ProviderCredential.org_id == org_id,
                    ProviderCredential.provider_id == provider_id,
                )
                .with_for_update()
            ).one_or_none()
            if row is None:
                session.add(
                    ProviderCredential(
                        org_id=org_id, provider_id=provider_id, ciphertext=ciphertext
                    )
                )
            else:
                row.ciphertext = ciphertext
                row.updated_at = utcnow()

    def names(self, org_id: str) -> list[tuple[str, datetime]]:
        """The providers the org has a credential for, and when each was stored: never
        the credential."""
        query = (
            select(ProviderCredential.provider_id, ProviderCredential.updated_at)
            .where(ProviderCredential.org_id == org_id)
            .order_by(ProviderCredential.provider_id)
        )
        with Session(self.engine) as session:
            return [(provider_id, at) for provider_id, at in session.execute(query)]

    def delete(self, org_id: str, provider_id: str) -> bool:
        """Forget the org's credential for the provider; whether there was one."""
        with Session(self.engine) as session, session.begin():
            result = session.execute(
                delete(ProviderCredential).where(
                    ProviderCredential.org_id == org_id,
                    ProviderCredential.provider_id == provider_id,
                )
            )
            return bool(getattr(result, "rowcount", 0))
