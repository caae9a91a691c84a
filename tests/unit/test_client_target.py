"""Where corral.client finds the api and its token: arguments, then the environment, then
the files `corral dev` leaves in its state directory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from corral.cli import api_target
from corral.cli.api_target import publish
from corral.client import Client, ClientConfigError, find_target

NAMES = ("CORRAL_API_URL", "CORRAL_API_KEY", "CORRAL_ADMIN_TOKEN", "CORRAL_API_SOCKET")


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory of its own, and none of the api variables set."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    return tmp_path


def test_corral_devs_files_are_the_last_resort(state_dir: Path) -> None:
    publish(state_dir, "http://127.0.0.1:8123", "dev-token")
    found = find_target()
    assert (found.url, found.token) == ("http://127.0.0.1:8123", "dev-token")


def test_the_environment_wins_over_the_files(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(state_dir, "http://127.0.0.1:8123", "dev-token")
    monkeypatch.setenv("CORRAL_API_URL", "https://corral.example")
    monkeypatch.setenv("CORRAL_ADMIN_TOKEN", "admin-token")
    assert (find_target().url, find_target().token) == ("https://corral.example", "admin-token")
    monkeypatch.setenv("CORRAL_API_KEY", "cok_org-key")  # an org key wins over the admin token
    assert find_target().token == "cok_org-key"


def test_arguments_win_over_everything(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_API_URL", "https://corral.example")
    monkeypatch.setenv("CORRAL_API_KEY", "cok_org-key")
    found = find_target("http://api.internal:8000", "cok_other")
    assert (found.url, found.token) == ("http://api.internal:8000", "cok_other")


def test_no_token_anywhere_is_a_configuration_error(state_dir: Path) -> None:
    with pytest.raises(ClientConfigError, match="CORRAL_API_KEY"):
        Client("http://127.0.0.1:1")


def test_a_unix_url_names_the_socket_and_no_token_is_shown(state_dir: Path) -> None:
    found = find_target("unix:///run/corral/api.sock", "secret-token")
    assert (found.socket, found.base_url) == ("/run/corral/api.sock", "http://corral")
    assert "secret-token" not in repr(found)
    with pytest.raises(ClientConfigError, match="absolute path"):
        find_target("unix://relative.sock", "t")
    with Client("unix:///run/corral/api.sock", "secret-token") as corral:
        assert "secret-token" not in repr(corral)


def test_the_api_url_file_is_never_read_half_written(tmp_path: Path) -> None:
    """``corral dev`` writes its api URL while other commands may read it: a reader sees the
    old URL or the new one, never an empty or partial file."""
    urls = [f"http://127.0.0.1:{port}" for port in (8300, 18300)]
    api_target.publish(tmp_path, urls[0], "token")
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            for url in urls:
                api_target.publish(tmp_path, url, "token")

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        seen = {(tmp_path / api_target.API_URL_FILE).read_text().strip() for _ in range(3000)}
    finally:
        stop.set()
        writer.join()
    assert seen <= set(urls), seen - set(urls)
    assert (tmp_path / api_target.API_URL_FILE).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
