"""Named secrets in the store, on SQLite and real PostgreSQL: set, list, delete, resolve;
an org's secret shadows the deployment's, one org never resolves another's, a ciphertext
moved to another org's row or another name does not open, and nothing stored or listed
holds a value."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from corral.shared.errors import ConfigurationError
from corral.shared.keyring import SealedElsewhereError
from corral.shared.store import secrets
from corral.shared.store.db import Database
from corral.shared.store.models import NamedSecret, SecretUseRecord
from corral.shared.store.sealing import Sealer
from tests.conftest import TEST_SECRET_KEY

VALUE_A = "value-of-acme-4711"
VALUE_B = "value-of-globex-0815"
VALUE_D = "value-of-the-deployment-2342"


def test_a_secret_round_trips_and_is_replaced_in_place(own_db: Database) -> None:
    assert secrets.set_secret(own_db, "acme", "api-token", VALUE_A) is True
    listed = secrets.list_secrets(own_db, "acme")
    assert [(s.name, s.scope, s.org) for s in listed] == [("api-token", "org", "acme")]
    assert secrets.resolve_secret(own_db, "acme", "api-token") == VALUE_A

    assert secrets.set_secret(own_db, "acme", "api-token", "replaced") is False
    again = secrets.list_secrets(own_db, "acme")
    assert again[0].created_at == listed[0].created_at
    assert again[0].updated_at >= listed[0].updated_at
    assert secrets.resolve_secret(own_db, "acme", "api-token") == "replaced"

    assert secrets.delete_secret(own_db, "acme", "api-token") is True
    assert secrets.delete_secret(own_db, "acme", "api-token") is False
    with pytest.raises(secrets.UnknownSecretError) as raised:
        secrets.resolve_secret(own_db, "acme", "api-token")
    assert raised.value.code == "unknown_secret" and "api-token" in raised.value.message


def test_nothing_stored_or_listed_holds_a_value(own_db: Database) -> None:
    secrets.set_secret(own_db, "acme", "api-token", VALUE_A)
    secrets.set_secret(own_db, None, "shared", VALUE_D)
    with own_db.session() as session:
        stored = session.execute(text("SELECT * FROM named_secrets")).all()
    dumped = repr(stored)
    assert VALUE_A not in dumped and VALUE_D not in dumped
    assert "corral-sealed:v2:" in dumped
    listed = [s.as_json() for s in secrets.list_secrets(own_db, "acme")]
    listed += [s.as_json() for s in secrets.list_secrets(own_db, None)]
    assert VALUE_A not in repr(listed) and VALUE_D not in repr(listed)
    assert [s["scope"] for s in listed] == ["org", "deployment"]


def test_an_org_secret_shadows_the_deployments_and_orgs_stay_apart(own_db: Database) -> None:
    secrets.set_secret(own_db, None, "token", VALUE_D)
    secrets.set_secret(own_db, "acme", "token", VALUE_A)
    secrets.set_secret(own_db, "globex", "only-globex", VALUE_B)

    keyring = own_db.sealer.keyring
    assert keyring is not None
    with own_db.session() as session:
        acme = secrets.resolve(session, keyring, "acme", "token")
        other = secrets.resolve(session, keyring, "initech", "token")
    assert (acme.scope, acme.value) == ("org", VALUE_A)
    assert (other.scope, other.value) == ("deployment", VALUE_D)
    # An org never resolves another org's secret, nor lists it.
    with pytest.raises(secrets.UnknownSecretError):
        secrets.resolve_secret(own_db, "acme", "only-globex")
    assert [s.name for s in secrets.list_secrets(own_db, "acme")] == ["token"]
    assert [s.name for s in secrets.list_secrets(own_db, None)] == ["token"]
    with own_db.session() as session:
        gone = secrets.missing(
            session, [("acme", "token"), ("acme", "only-globex"), ("globex", "only-globex")]
        )
    assert gone == {("acme", "only-globex")}


@pytest.mark.parametrize("moved_to", [("globex", "token"), ("acme", "other-name"), ("*", "token")])
def test_a_ciphertext_moved_to_another_org_or_name_does_not_open(
    own_db: Database, moved_to: tuple[str, str]
) -> None:
    secrets.set_secret(own_db, "acme", "token", VALUE_A)
    org, name = moved_to
    with own_db.session() as session:
        sealed = session.scalars(select(NamedSecret.sealed).where(NamedSecret.org_id == "acme"))
        session.add(NamedSecret(org_id=org, name=name, sealed=sealed.one()))
    with pytest.raises(SealedElsewhereError) as raised:
        secrets.resolve_secret(own_db, "globex" if org == "*" else org, name)
    assert VALUE_A not in raised.value.message
    assert secrets.resolve_secret(own_db, "acme", "token") == VALUE_A  # the original opens


def test_names_and_values_are_bounded(own_db: Database) -> None:
    for name in ["", "-leading", "a" * 64, "with space", "ünïcode", "a/b"]:
        with pytest.raises(secrets.SecretError):
            secrets.set_secret(own_db, "acme", name, "v")
    for value in ["", "a\x00b", "x" * (secrets.MAX_VALUE + 1)]:
        with pytest.raises(secrets.SecretError) as raised:
            secrets.set_secret(own_db, "acme", "ok", value)
        assert value not in raised.value.message or not value
    assert secrets.set_secret(own_db, "acme", "a" * 63, "x" * secrets.MAX_VALUE)
    assert secrets.set_secret(own_db, "acme", "multi", "line one\nline two\n")
    assert secrets.resolve_secret(own_db, "acme", "multi") == "line one\nline two\n"


def _for_item(session: Session, item_id: str, refs: dict[str, str], *, binding: bool) -> Any:
    keyring = Sealer(TEST_SECRET_KEY).keyring
    assert keyring is not None
    used_in = secrets.UsedIn.BINDING if binding else secrets.UsedIn.ENV
    return secrets.resolve_for_item(session, keyring, (item_id, "acme"), refs, used_in)


def test_resolving_for_an_item_records_uses_never_values(own_db: Database) -> None:
    secrets.set_secret(own_db, None, "shared", VALUE_D)
    secrets.set_secret(own_db, "acme", "mine", VALUE_A)
    keyring = own_db.sealer.keyring
    assert keyring is not None
    with own_db.session() as session:
        got = _for_item(session, "wi-1", {"TOKEN": "mine", "SHARED": "shared"}, binding=False)
    assert got == {"TOKEN": VALUE_A, "SHARED": VALUE_D}
    with own_db.session() as session:
        uses = secrets.uses_of(session, "wi-1")
        values = secrets.used_values(session, keyring, {"wi-1": "acme"})["wi-1"]
        rows = session.execute(select(SecretUseRecord)).scalars().all()
    assert [(u["name"], u["scope"], u["used_in"], u["target"]) for u in uses] == [
        ("mine", "org", "env", "TOKEN"),
        ("shared", "deployment", "env", "SHARED"),
    ]
    assert sorted(values) == sorted([VALUE_A, VALUE_D])
    assert VALUE_A not in repr([vars(row) for row in rows])

    # A missing one: nothing is recorded, and the error names the field and the secret.
    with own_db.session() as session, pytest.raises(secrets.UnknownSecretError) as raised:
        _for_item(session, "wi-2", {"A": "mine", "B": "gone"}, binding=True)
    assert "gone" in raised.value.message and "egress.secret_bindings.B" in raised.value.message
    with own_db.session() as session:
        assert secrets.uses_of(session, "wi-2") == []


def test_without_a_secret_key_nothing_is_stored(own_db: Database) -> None:
    keyless = Database(own_db.engine, sealer=Sealer(keyring=None))
    with pytest.raises(ConfigurationError) as raised:
        secrets.set_secret(keyless, "acme", "token", VALUE_A)
    assert "CORRAL_SECRET_KEY" in raised.value.message
    assert secrets.list_secrets(own_db, "acme") == []
