"""Sealing secrets at rest: a key per purpose, each ciphertext bound to its place.

Every secret corral keeps (dispatch env and binding values, named secrets, provider
credentials, provider configurations, webhook signing secrets) is sealed here and nowhere else:

- the key is derived from the deployment's ``CORRAL_SECRET_KEY`` by HKDF-SHA256, one key
  per :class:`Purpose` (HKDF's ``info`` names it), so that a key for one purpose opens
  nothing of another;
- the cipher is AES-256-GCM, and its associated data is the purpose and the value's place
  (org, item and field of an env value; org and name of a named secret; org and provider of
  a credential; endpoint of a webhook secret): a ciphertext copied to another row or
  another item's payload does not open (:class:`SealedElsewhereError`);
- the format is ``corral-sealed:v2:<key id>:<base64 of nonce and ciphertext>``; the key id
  says which key sealed it, so a value sealed before a rotation is opened with the previous
  key (``CORRAL_SECRET_KEY_PREVIOUS``) until ``corral secret-key rotate`` seals it again.

Values sealed before this format (``corral-sealed:v1:`` and bare Fernet tokens: one key, no
context) stay readable, with any configured key, until rotated.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import SecretStr

from corral.shared.errors import ConfigurationError, SecretKeyMismatchError

SEALED_V2 = "corral-sealed:v2:"
SEALED_V1 = "corral-sealed:v1:"
MIN_KEY_LENGTH = 32
MIN_KEY_BITS = 128
_SALT = b"corral sealing v2"
_NONCE = 12
_LEGACY_INFO = b"corral provider credentials"  # v1: one key for everything, no salt


class Purpose(enum.StrEnum):
    """What a sealed value is; each has its own key."""

    ENV = "dispatch env values"
    CREDENTIAL = "provider credentials"
    PROVIDER_CONFIG = "provider configs"
    WEBHOOK = "webhook secrets"
    NAMED = "named secrets"


class SealedElsewhereError(SecretKeyMismatchError):
    """a sealed value does not belong where it was found (copied from another org, item or
    row), or was altered"""

    code = "sealed_elsewhere"


def check_secret_key(raw: str, *, setting: str = "CORRAL_SECRET_KEY") -> None:
    """Refuse a key that is short or of low entropy; the message never shows the key.

    Raises:
        ConfigurationError: fewer than 32 characters, fewer than ~128 bits estimated from
            its character classes and length, few distinct characters or a repeated pattern.
    """
    how = "generate one with `corral secret-key`"
    if len(raw) < MIN_KEY_LENGTH:
        raise ConfigurationError(
            f"{setting} must be at least {MIN_KEY_LENGTH} characters (it has {len(raw)}); {how}"
        )
    if _estimated_bits(raw) < MIN_KEY_BITS or _repeats(raw) or _lopsided(raw):
        raise ConfigurationError(
            f"{setting} is of low entropy (too few distinct characters or a repeated "
            f"pattern); {how}"
        )


def _estimated_bits(raw: str) -> float:
    classes = (
        (str.islower, 26),
        (str.isupper, 26),
        (str.isdigit, 10),
    )
    alphabet = sum(size for test, size in classes if any(test(c) for c in raw))
    if any(not (c.isascii() and c.isalnum()) for c in raw):
        alphabet += 33
    return len(raw) * math.log2(max(alphabet, 2))


def _lopsided(raw: str) -> bool:
    """Few distinct characters, or one of them a quarter of the string or more."""
    most = max(raw.count(c) for c in set(raw))
    return len(set(raw)) < 10 or most * 4 > len(raw)


def _repeats(raw: str) -> bool:
    """Whether ``raw`` is a shorter string repeated (``abcabcabc...``)."""
    return any(
        raw == (raw[:period] * (len(raw) // period + 1))[: len(raw)]
        for period in range(1, len(raw) // 2 + 1)
    )


def _raw(key: SecretStr | str) -> str:
    return key.get_secret_value() if isinstance(key, SecretStr) else key


def key_id(key: SecretStr | str) -> str:
    """A short public name of a key (derived one-way, revealing nothing of it)."""
    digest = HKDF(algorithm=hashes.SHA256(), length=6, salt=_SALT, info=b"corral key id")
    return digest.derive(_raw(key).encode()).hex()


def is_sealed(text: str) -> bool:
    return text.startswith((SEALED_V2, SEALED_V1))


class Keyring:
    """The current key, which seals, and the previous ones, which still open."""

    def __init__(self, current: SecretStr | str, previous: Sequence[SecretStr | str] = ()) -> None:
        check_secret_key(_raw(current))  # previous keys are only read: any is accepted
        keys = [_raw(current), *(_raw(key) for key in previous)]
        self.current_id = key_id(keys[0])
        self._keys = {key_id(key): key.encode() for key in keys}
        self._legacy = [
            Fernet(base64.urlsafe_b64encode(_derive(key.encode(), _LEGACY_INFO, None)))
            for key in keys
        ]

    def seal(self, text: str, purpose: Purpose, *place: str) -> str:
        """``text`` sealed under the current key, bound to ``purpose`` and ``place``."""
        nonce = os.urandom(_NONCE)
        aead = AESGCM(self._key(self.current_id, purpose))
        sealed = aead.encrypt(nonce, text.encode(), _context(purpose, place))
        body = base64.urlsafe_b64encode(nonce + sealed).decode()
        return f"{SEALED_V2}{self.current_id}:{body}"

    def open(self, sealed: str, purpose: Purpose, *place: str) -> str:
        """The text of ``sealed``, which must have been sealed for ``purpose`` at ``place``.

        Raises:
            SealedElsewhereError: it was sealed for another place or purpose, or altered.
            SecretKeyMismatchError: it was sealed with a key this process does not have.
        """
        if not sealed.startswith(SEALED_V2):
            return self._open_legacy(sealed.removeprefix(SEALED_V1))
        kid, _, body = sealed.removeprefix(SEALED_V2).partition(":")
        if kid not in self._keys:
            raise SecretKeyMismatchError(
                f"a sealed {purpose.value[:-1]} cannot be opened: the key changed since it "
                f"was sealed (key id {kid}, which this process does not have); set that key "
                "in CORRAL_SECRET_KEY_PREVIOUS on every process, or store the value again"
            )
        try:
            blob = base64.urlsafe_b64decode(body.encode())
            opened = AESGCM(self._key(kid, purpose)).decrypt(
                blob[:_NONCE], blob[_NONCE:], _context(purpose, place)
            )
        except (InvalidTag, ValueError, binascii.Error) as exc:
            raise SealedElsewhereError(
                f"a sealed {purpose.value[:-1]} does not belong here (it was sealed for "
                "another org, item or field, or altered) and is not opened"
            ) from exc
        return opened.decode()

    def needs_reseal(self, sealed: str) -> bool:
        """Whether ``sealed`` depends on a key other than the current one or an old format."""
        return not sealed.startswith(f"{SEALED_V2}{self.current_id}:")

    def _open_legacy(self, token: str) -> str:
        for fernet in self._legacy:
            try:
                return fernet.decrypt(token.encode()).decode()
            except InvalidToken:
                continue
        raise SecretKeyMismatchError(
            "a value sealed before corral-sealed:v2 cannot be opened with CORRAL_SECRET_KEY "
            "or CORRAL_SECRET_KEY_PREVIOUS: the key changed since it was stored; set the "
            "previous key in CORRAL_SECRET_KEY_PREVIOUS or store the value again"
        )

    def _key(self, kid: str, purpose: Purpose) -> bytes:
        return _derive(self._keys[kid], f"corral {purpose.value}".encode(), _SALT)


def keyring_of(settings: object) -> Keyring | None:
    """The keyring of a process's settings (``secret_key``, ``secret_key_previous``), or
    None without a secret key."""
    current = getattr(settings, "secret_key", None)
    if current is None:
        return None
    previous = getattr(settings, "secret_key_previous", None)
    listed = _raw(previous).split(",") if previous is not None else []
    return Keyring(current, [key.strip() for key in listed if key.strip()])


def required_keyring(settings: object) -> Keyring:
    """:func:`keyring_of`, which must be there.

    Raises:
        ConfigurationError: no CORRAL_SECRET_KEY.
    """
    keyring = keyring_of(settings)
    if keyring is None:
        raise ConfigurationError(
            "CORRAL_SECRET_KEY is not set, so secrets cannot be sealed or opened; generate "
            "one with `corral secret-key` and set it on every process"
        )
    return keyring


def _derive(key: bytes, info: bytes, salt: bytes | None) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(key)


def _context(purpose: Purpose, place: Sequence[str]) -> bytes:
    return json.dumps([purpose.value, *place], separators=(",", ":")).encode()
