"""``corral dev`` serves plain http on loopback: it sets the console's insecure-cookie
setting for its own api, unless the environment says otherwise or the api listens beyond
loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.cli.dev import dev_settings
from corral.shared.settings import ApiSettings


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CORRAL_CONSOLE_INSECURE_COOKIE", raising=False)
    monkeypatch.delenv("CORRAL_API_HOST", raising=False)


def test_the_cookie_is_secure_unless_a_setting_says_otherwise() -> None:
    assert ApiSettings().console_insecure_cookie is False


@pytest.mark.parametrize(
    ("host", "insecure"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("192.0.2.10", False),
        ("corral.example", False),
    ],
)
def test_corral_dev_sets_the_insecure_cookie_on_loopback_only(
    host: str, insecure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_API_HOST", host)
    assert dev_settings(demo=False, port=0).console_insecure_cookie is insecure


def test_corral_dev_keeps_what_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_CONSOLE_INSECURE_COOKIE", "false")
    assert dev_settings(demo=False, port=0).console_insecure_cookie is False
