"""The keyring: a key per purpose, each ciphertext bound to its place, key ids for
rotation, old formats still read, and weak keys refused without being shown."""

from __future__ import annotations

import base64

import pytest
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from corral.shared.errors import ConfigurationError, SecretKeyMismatchError
from corral.shared.keyring import (
    SEALED_V1,
    SEALED_V2,
    Keyring,
    Purpose,
    SealedElsewhereError,
    check_secret_key,
    key_id,
    keyring_of,
)

OLD = "tests-only-key-A1b2C3d4E5f6G7h8J9k0"
NEW = "tests-only-key-Z9y8X7w6V5u4T3s2R1q0"


def legacy_token(key: str, text: str) -> str:
    """A value as sealed before v2: Fernet under HKDF(info 'corral provider credentials')."""
    derived = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"corral provider credentials"
    ).derive(key.encode())
    return Fernet(base64.urlsafe_b64encode(derived)).encrypt(text.encode()).decode()


def test_the_format_names_the_key_that_sealed_it_and_opens_in_its_place() -> None:
    sealed = Keyring(NEW).seal("s3cret", Purpose.ENV, "acme", "wi-1", "env.TOKEN")
    assert sealed.startswith(f"{SEALED_V2}{key_id(NEW)}:") and "s3cret" not in sealed
    assert Keyring(NEW).open(sealed, Purpose.ENV, "acme", "wi-1", "env.TOKEN") == "s3cret"
    assert key_id(NEW) != key_id(OLD) and NEW not in key_id(NEW)


@pytest.mark.parametrize(
    ("purpose", "place"),
    [
        (Purpose.ENV, ("globex", "wi-1", "env.TOKEN")),
        (Purpose.ENV, ("acme", "wi-2", "env.TOKEN")),
        (Purpose.ENV, ("acme", "wi-1", "env.OTHER")),
        (Purpose.CREDENTIAL, ("acme", "wi-1", "env.TOKEN")),
    ],
)
def test_a_value_opens_nowhere_else(purpose: Purpose, place: tuple[str, ...]) -> None:
    sealed = Keyring(NEW).seal("s3cret", Purpose.ENV, "acme", "wi-1", "env.TOKEN")
    with pytest.raises(SealedElsewhereError) as raised:
        Keyring(NEW).open(sealed, purpose, *place)
    assert raised.value.code == "sealed_elsewhere" and "s3cret" not in str(raised.value)


def test_an_altered_value_does_not_open() -> None:
    sealed = Keyring(NEW).seal("s3cret", Purpose.ENV, "acme")
    flipped = sealed[:-2] + ("A" if sealed[-2] != "A" else "B") + sealed[-1]
    with pytest.raises(SealedElsewhereError):
        Keyring(NEW).open(flipped, Purpose.ENV, "acme")


def test_previous_keys_open_what_they_sealed_and_say_it_needs_resealing() -> None:
    sealed = Keyring(OLD).seal("s3cret", Purpose.WEBHOOK, "acme", "wh-1")
    rotated = Keyring(NEW, [OLD])
    assert rotated.open(sealed, Purpose.WEBHOOK, "acme", "wh-1") == "s3cret"
    assert rotated.needs_reseal(sealed)
    assert not rotated.needs_reseal(rotated.seal("s3cret", Purpose.WEBHOOK, "acme", "wh-1"))
    with pytest.raises(SecretKeyMismatchError, match="key changed") as raised:
        Keyring(NEW).open(sealed, Purpose.WEBHOOK, "acme", "wh-1")
    assert raised.value.code == "secret_key_mismatch" and key_id(OLD) in str(raised.value)


def test_values_sealed_before_v2_are_read_with_any_configured_key() -> None:
    token = legacy_token(OLD, "s3cret")
    rotated = Keyring(NEW, [OLD])
    assert rotated.open(token, Purpose.CREDENTIAL, "acme", "e2b") == "s3cret"
    assert rotated.open(SEALED_V1 + token, Purpose.ENV, "acme", "wi-1", "env.A") == "s3cret"
    assert rotated.needs_reseal(token) and rotated.needs_reseal(SEALED_V1 + token)
    with pytest.raises(SecretKeyMismatchError):
        Keyring(NEW).open(token, Purpose.CREDENTIAL, "acme", "e2b")


def test_a_previous_key_may_be_weak_it_is_only_read() -> None:
    weak = "sixteen-chars-ok"
    token = legacy_token(weak, "s3cret")
    assert Keyring(NEW, [weak]).open(token, Purpose.CREDENTIAL, "a", "b") == "s3cret"


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("short-key-0123", "at least 32 characters"),
        ("a" * 40, "low entropy"),
        ("abcd" * 10, "low entropy"),
        ("old-key-" + "a" * 32, "low entropy"),
        ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaabcdefghijklmnop", "low entropy"),
        ("0123456789" * 4, "low entropy"),
        ("Zq8!" * 10, "low entropy"),
    ],
)
def test_weak_keys_are_refused_saying_how_to_make_one(key: str, said: str) -> None:
    with pytest.raises(ConfigurationError, match=said) as raised:
        check_secret_key(key)
    assert "corral secret-key" in str(raised.value)
    assert key not in str(raised.value)


def test_generated_keys_pass() -> None:
    import secrets

    for _ in range(50):
        check_secret_key(secrets.token_urlsafe(32))
    check_secret_key(secrets.token_hex(16))  # 128 bits, exactly


def test_the_settings_give_the_current_and_previous_keys() -> None:
    class Settings:
        secret_key = NEW
        secret_key_previous = f" {OLD} ,"

    sealed = Keyring(OLD).seal("s3cret", Purpose.PROVIDER_CONFIG, "e2b")
    keyring = keyring_of(Settings())
    assert keyring is not None and keyring.current_id == key_id(NEW)
    assert keyring.open(sealed, Purpose.PROVIDER_CONFIG, "e2b") == "s3cret"


def test_corral_secret_key_prints_a_key_that_is_accepted() -> None:
    from typer.testing import CliRunner

    from corral.cli.app import app

    printed = CliRunner().invoke(app, ["secret-key"])
    assert printed.exit_code == 0
    check_secret_key(printed.output.strip())
