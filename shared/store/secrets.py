"""Named secrets: values kept by name, an org's or the deployment's, sealed at rest.

A dispatch message refers to a secret by its name (``secret_env``, a secret binding's
``secret``) instead of carrying its value, so the value never travels through the broker.
The value is read from here late, by the process that hands it on: the api at the runner's
claim (env), the provider worker at provision (bindings). Each such resolution writes a
:class:`~corral.shared.store.models.SecretUseRecord` (name, scope, where; never the value).

An org's secret shadows the deployment's of the same name (:func:`resolve`). A value is
sealed by :mod:`corral.shared.keyring` for :attr:`~corral.shared.keyring.Purpose.NAMED`,
bound to its org (``*`` for the deployment's) and its name: a ciphertext copied to another
org's row or another name does not open (``sealed_elsewhere``).

What other modules call: :func:`resolve_secret` (one value, by org and name),
:func:`resolve_for_item` (an item's references, resolved and recorded together).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, or_, select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from corral.shared.errors import ConfigurationError, CorralError
from corral.shared.keyring import Keyring, Purpose
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import NamedSecret, SecretUseRecord
from corral.shared.text import IDENTIFIER

DEPLOYMENT = "*"  # the org column of a deployment-wide secret: no org id can be "*"
# Characters; a value JSON-escaped within the api's default body limit (64 KiB) however set.
MAX_VALUE = 32_768
NAME_PATTERN = IDENTIFIER  # letters, digits, '.', '_', '-', at most 63, starting alphanumeric
MAX_SECRETS = 1000  # of one org (or of the deployment): what an org key may store is bounded
_NAME = re.compile(NAME_PATTERN)


class SecretScope(enum.StrEnum):
    ORG = "org"
    DEPLOYMENT = "deployment"


class UsedIn(enum.StrEnum):
    """Where a resolved secret went."""

    ENV = "env"  # the work's environment, through the runner's claim
    BINDING = "binding"  # a secret binding's value, to the egress proxy at provision
    GIT = "git"  # a git input's credential, to the egress proxy at provision

    @property
    def field_prefix(self) -> str:
        """The message's field that refers to secrets used so."""
        return {
            UsedIn.ENV: "secret_env.",
            UsedIn.BINDING: "egress.secret_bindings.",
            UsedIn.GIT: "inputs.",
        }.get(self, f"{self.value}.")


class SecretError(CorralError, ValueError):
    """a named secret's name or value is refused"""

    code = "invalid_secret"


class UnknownSecretError(CorralError, LookupError):
    """no named secret of that name for the org or the deployment"""

    code = "unknown_secret"

    def __init__(self, name: str, *, where: str | None = None) -> None:
        # A secret's name is not secret: it is named, so the sender knows which one.
        place = f" ({where})" if where else ""
        super().__init__(
            f"no named secret {name}{place} for the item's org or the deployment: set it "
            "with `corral secrets set` (or PUT /v1/admin/orgs/{org}/secrets/{name}), then "
            "dispatch the item again"
        )
        self.name = name


@dataclass(frozen=True)
class SecretInfo:
    """What is shown of a named secret: never its value."""

    name: str
    scope: SecretScope
    org: str | None
    created_at: datetime
    updated_at: datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scope": self.scope.value,
            "org": self.org,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class ResolvedSecret:
    """A named secret's value and where it was found."""

    name: str
    scope: SecretScope
    value: str = field(repr=False)


def check_name(name: str) -> str:
    """``name`` unchanged.

    Raises:
        SecretError: not 1-63 letters, digits, '.', '_' or '-' starting with a letter or digit.
    """
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise SecretError(
            "a secret's name is 1-63 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit"
        )
    return name


def check_value(value: str) -> str:
    """``value`` unchanged.

    Raises:
        SecretError: empty, over :data:`MAX_VALUE` characters, or holding a NUL.
    """
    if not value:
        raise SecretError("a secret's value must not be empty")
    if len(value) > MAX_VALUE:
        raise SecretError(f"a secret's value is at most {MAX_VALUE} characters")
    if "\x00" in value:
        raise SecretError("a secret's value must not contain NUL characters")
    return value


def _owner(org_id: str | None) -> str:
    return DEPLOYMENT if org_id is None else org_id


def _keyring(db: Database) -> Keyring:
    return _required(db.sealer.keyring)


def _required(keyring: Keyring | None) -> Keyring:
    if keyring is None:
        raise ConfigurationError(
            "CORRAL_SECRET_KEY is not set, so named secrets cannot be sealed or opened; "
            "generate one with `corral secret-key` and set it on every process"
        )
    return keyring


def seal_value(keyring: Keyring, owner: str, name: str, value: str) -> bytes:
    """A named secret's value as stored: sealed, bound to its owner (an org, or ``*``) and
    name."""
    return keyring.seal(value, Purpose.NAMED, owner, name).encode()


def open_value(keyring: Keyring, owner: str, name: str, sealed: bytes) -> str:
    """The value of a stored named secret.

    Raises:
        SealedElsewhereError: it was sealed for another owner or name (copied), or altered.
        SecretKeyMismatchError: it was sealed with a key this process does not have.
    """
    return keyring.open(sealed.decode(), Purpose.NAMED, owner, name)


def set_secret(db: Database, org_id: str | None, name: str, value: str) -> bool:
    """Create or replace the named secret of ``org_id`` (None: the deployment's); whether
    it was created.

    Raises:
        SecretError: the name or value is refused, or it would be one more than MAX_SECRETS.
        ConfigurationError: no CORRAL_SECRET_KEY to seal it with.
    """
    check_name(name)
    check_value(value)
    owner = _owner(org_id)
    sealed = seal_value(_keyring(db), owner, name, value)
    for _ in range(2):  # a concurrent create of the same name: replace what it wrote
        try:
            with db.session() as session:
                return _upsert(session, owner, name, sealed)
        except IntegrityError:
            continue
    raise AssertionError("a named secret's row was created and removed concurrently twice")


def _upsert(session: Session, owner: str, name: str, sealed: bytes) -> bool:
    row = session.scalars(
        select(NamedSecret)
        .where(NamedSecret.org_id == owner, NamedSecret.name == name)
        .with_for_update()
    ).one_or_none()
    now = utcnow()
    if row is None:
        _check_room(session, owner)
        session.add(
            NamedSecret(org_id=owner, name=name, sealed=sealed, created_at=now, updated_at=now)
        )
        session.flush()
        return True
    row.sealed, row.updated_at = sealed, now
    return False


def _check_room(session: Session, owner: str) -> None:
    """Refuse a new secret of ``owner`` past MAX_SECRETS.

    Raises:
        SecretError: it holds MAX_SECRETS already.
    """
    if session.get_bind().dialect.name == "postgresql":
        # One creation per owner at a time (until this transaction ends): two at once would
        # both count before either is written. SQLite has one writer already.
        lock = func.hashtextextended(f"corral named secrets of {owner}", 0)
        session.execute(select(func.pg_advisory_xact_lock(lock)))
    held = session.scalar(
        select(func.count()).select_from(NamedSecret).where(NamedSecret.org_id == owner)
    )
    if (held or 0) >= MAX_SECRETS:
        raise SecretError(
            f"an org (or the deployment) holds at most {MAX_SECRETS} named secrets: delete "
            "one first"
        )


def list_secrets(db: Database, org_id: str | None) -> list[SecretInfo]:
    """The named secrets of ``org_id`` (None: the deployment's), by name; never values."""
    query = (
        select(NamedSecret.name, NamedSecret.created_at, NamedSecret.updated_at)
        .where(NamedSecret.org_id == _owner(org_id))
        .order_by(NamedSecret.name)
    )
    scope = SecretScope.DEPLOYMENT if org_id is None else SecretScope.ORG
    with db.session() as session:
        return [
            SecretInfo(name, scope, org_id, created, updated)
            for name, created, updated in session.execute(query)
        ]


def delete_secret(db: Database, org_id: str | None, name: str) -> bool:
    """Forget the named secret of ``org_id`` (None: the deployment's); whether there was one."""
    with db.session() as session:
        result = session.execute(
            delete(NamedSecret).where(
                NamedSecret.org_id == _owner(org_id), NamedSecret.name == name
            )
        )
        return bool(getattr(result, "rowcount", 0))


def resolve(session: Session, keyring: Keyring, org_id: str, name: str) -> ResolvedSecret:
    """The secret ``name`` of ``org_id``, else the deployment's of that name.

    Raises:
        UnknownSecretError: neither has one.
        SealedElsewhereError: the stored value was sealed for another org or name.
        SecretKeyMismatchError: it was sealed with a key this process does not have.
    """
    rows = session.execute(
        select(NamedSecret.org_id, NamedSecret.sealed).where(
            NamedSecret.name == name, NamedSecret.org_id.in_([org_id, DEPLOYMENT])
        )
    ).all()
    found = {owner: sealed for owner, sealed in rows}
    for owner, scope in ((org_id, SecretScope.ORG), (DEPLOYMENT, SecretScope.DEPLOYMENT)):
        if owner in found:
            return ResolvedSecret(name, scope, open_value(keyring, owner, name, found[owner]))
    raise UnknownSecretError(name)


def resolve_secret(db: Database, org_id: str, name: str) -> str:
    """The value of the secret ``name`` for ``org_id`` (its own, else the deployment's).

    Raises:
        UnknownSecretError: neither has one.
        ConfigurationError: no CORRAL_SECRET_KEY, or the value cannot be opened here
            (another key, or sealed for another org or name: ``sealed_elsewhere``).
    """
    keyring = _keyring(db)
    with db.session() as session:
        return resolve(session, keyring, org_id, name).value


def missing(session: Session, wanted: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Those ``(org, name)`` of ``wanted`` for which neither the org nor the deployment has
    a secret of that name (one read, whatever the number)."""
    pairs = set(wanted)
    if not pairs:
        return set()
    names = {name for _, name in pairs}
    query = select(NamedSecret.org_id, NamedSecret.name).where(
        or_(
            tuple_(NamedSecret.org_id, NamedSecret.name).in_(sorted(pairs)),
            (NamedSecret.org_id == DEPLOYMENT) & NamedSecret.name.in_(sorted(names)),
        )
    )
    found = {(owner, name) for owner, name in session.execute(query)}
    return {(org, name) for org, name in pairs if not {(org, name), (DEPLOYMENT, name)} & found}


def resolve_for_item(
    session: Session,
    keyring: Keyring | None,
    item: tuple[str, str],
    refs: Mapping[str, str],
    used_in: UsedIn,
    *,
    record: bool = True,
) -> dict[str, str]:
    """Each of an item's references ``target -> secret name`` resolved (target: an env
    variable or binding name), and one use recorded per reference, in ``session``: all or
    none (a missing one raises before anything is recorded). ``item``: its id and org.
    ``record`` False: read again for a reader already recorded (a repeated claim).

    Raises:
        UnknownSecretError: a name has no secret (deleted since the dispatch); it names the
            field (``secret_env.VAR``, ``egress.secret_bindings.NAME``).
        ConfigurationError: a value cannot be opened (another key, or sealed elsewhere, or
            no CORRAL_SECRET_KEY).
    """
    if not refs:
        return {}
    item_id, org_id = item
    resolved: dict[str, ResolvedSecret] = {}
    for target, name in refs.items():
        try:
            resolved[target] = resolve(session, _required(keyring), org_id, name)
        except UnknownSecretError as exc:
            raise UnknownSecretError(name, where=f"{used_in.field_prefix}{target}") from exc
    if not record:
        return {target: secret.value for target, secret in resolved.items()}
    now = utcnow()
    session.add_all(
        SecretUseRecord(
            work_item_id=item_id,
            org_id=org_id,
            secret_name=secret.name,
            scope=secret.scope.value,
            used_in=used_in.value,
            target=target,
            at=now,
        )
        for target, secret in resolved.items()
    )
    return {target: secret.value for target, secret in resolved.items()}


def uses_of(session: Session, item_id: str) -> list[dict[str, Any]]:
    """The item's recorded uses of named secrets, oldest first: names only."""
    rows = session.scalars(
        select(SecretUseRecord)
        .where(SecretUseRecord.work_item_id == item_id)
        .order_by(SecretUseRecord.id)
    )
    return [
        {
            "name": row.secret_name,
            "scope": row.scope,
            "used_in": row.used_in,
            "target": row.target,
            "at": row.at.isoformat(),
        }
        for row in rows
    ]


def used_values(
    session: Session, keyring: Keyring | None, items: Mapping[str, str]
) -> dict[str, list[str]]:
    """The current values of the named secrets each item used (``items``: item id -> org),
    for redacting them from text its sandbox wrote; a secret deleted since is not known any
    more. Two reads, however many items.

    Raises:
        ConfigurationError: a value cannot be opened here.
    """
    used = session.execute(
        select(SecretUseRecord.work_item_id, SecretUseRecord.secret_name, SecretUseRecord.scope)
        .where(SecretUseRecord.work_item_id.in_(sorted(items)))
        .distinct()
    ).all()
    owners = {
        (item_id, name): DEPLOYMENT if scope == SecretScope.DEPLOYMENT else items[item_id]
        for item_id, name, scope in used
    }
    wanted = {(owner, name) for (_, name), owner in owners.items()}
    sealed = (
        {
            (owner, name): value
            for owner, name, value in session.execute(
                select(NamedSecret.org_id, NamedSecret.name, NamedSecret.sealed).where(
                    tuple_(NamedSecret.org_id, NamedSecret.name).in_(sorted(wanted))
                )
            )
        }
        if wanted
        else {}
    )
    values: dict[str, list[str]] = {item_id: [] for item_id in items}
    for (item_id, name), owner in sorted(owners.items()):
        if (owner, name) in sealed:
            opened = open_value(_required(keyring), owner, name, sealed[owner, name])
            values[item_id].append(opened)
    return values
