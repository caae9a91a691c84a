"""Dispatch env values at rest: sealed with the deployment's key, opened only to be used,
refused (and not kept) when there is no key to seal them with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.cli.dev import dev_settings
from corral.scheduler.batch import accept_batch
from corral.shared.errors import SecretKeyMismatchError
from corral.shared.keyring import SEALED_V2, SealedElsewhereError
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import Database
from corral.shared.store.models import ItemState, WorkItem
from corral.shared.store.sealing import WITHHELD, Sealer, is_withheld, stored
from tests.seeding import SETTINGS

KEY = "tests-only-key-A1b2C3d4E5f6G7h8J9k0"
SECRET = "sk-live-do-not-store-me-in-plain-text"


def payload() -> dict[str, object]:
    return {
        "org": "acme",
        "env": {"API_TOKEN": SECRET},
        "toolchain": {"env": {"NPM_TOKEN": SECRET + "-npm"}, "install_commands": ["true"]},
    }


def test_env_values_are_sealed_and_open_again_with_the_same_key() -> None:
    sealed = Sealer(KEY).seal(payload(), "acme", "wi-1")
    assert SECRET not in json.dumps(sealed)
    assert sealed["env"]["API_TOKEN"].startswith(SEALED_V2)
    assert sealed["toolchain"]["install_commands"] == ["true"]
    assert Sealer(KEY).open(sealed, "acme", "wi-1") == payload()


def test_values_moved_to_another_org_item_or_field_do_not_open() -> None:
    sealed = Sealer(KEY).seal(payload(), "acme", "wi-1")
    for org, item in (("globex", "wi-1"), ("acme", "wi-2")):
        with pytest.raises(SealedElsewhereError) as raised:
            Sealer(KEY).open(sealed, org, item)
        assert raised.value.code == "sealed_elsewhere" and SECRET not in str(raised.value)
    swapped = {**sealed, "env": {"OTHER": sealed["env"]["API_TOKEN"]}}
    with pytest.raises(SealedElsewhereError):
        Sealer(KEY).open(swapped, "acme", "wi-1")


def test_another_key_cannot_open_them_and_says_so() -> None:
    sealed = Sealer(KEY).seal(payload(), "acme", "wi-1")
    with pytest.raises(SecretKeyMismatchError, match="Restore the previous CORRAL_SECRET_KEY"):
        Sealer("tests-only-key-Z9y8X7w6V5u4T3s2R1q0").open(sealed, "acme", "wi-1")
    with pytest.raises(SecretKeyMismatchError, match="no CORRAL_SECRET_KEY") as missing:
        Sealer(None).open(sealed, "acme", "wi-1")
    assert missing.value.code == "secret_key_mismatch"
    assert SECRET not in str(missing.value)


def test_without_a_key_the_values_are_withheld_not_stored() -> None:
    kept = stored(payload(), Sealer(None), "acme", "wi-1")
    assert SECRET not in json.dumps(kept)
    assert kept["env"] == {"API_TOKEN": WITHHELD} and is_withheld(kept)
    empty = {"org": "acme", "env": {}}
    assert stored(empty, Sealer(None), "acme", "wi-1") == empty


def test_a_message_with_env_and_no_key_is_a_dispatch_error_that_keeps_no_value(
    sqlite_db: Database,
) -> None:
    db = Database(sqlite_db.engine, sealer=Sealer(None))
    message = {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "env": {"API_TOKEN": SECRET},
        "work": {"kind": "shell", "command": "true"},
    }
    [taken] = accept_batch(
        db, [DispatchRequest.model_validate(message)], actor="test", settings=SETTINGS
    )
    assert taken.outcome.state is ItemState.DISPATCH_ERROR
    with db.session() as session:
        item = session.get_one(WorkItem, taken.item_id)
        assert (item.state, item.error_code) == ("dispatch_error", "secret_key_missing")
        assert "corral secret-key" in (item.error_message or "")
        assert SECRET not in json.dumps(item.payload)


def test_corral_dev_keeps_one_key_per_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CORRAL_SECRET_KEY", raising=False)
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    first = dev_settings(demo=False, port=0).secret_key
    second = dev_settings(demo=False, port=0).secret_key
    assert first is not None and second is not None
    assert first.get_secret_value() == second.get_secret_value()
    assert (tmp_path / "secret-key").stat().st_mode & 0o077 == 0
