"""Where the api of this deployment is, for the commands that talk to it.

``corral dev`` writes its api's URL to ``<state_dir>/api-url`` and its admin token to
``<state_dir>/admin-token`` (both readable by the owner only); a command reads
``CORRAL_API_URL`` and ``CORRAL_ADMIN_TOKEN`` first, then those files, and falls back to
``http://CORRAL_API_HOST:CORRAL_API_PORT``. ``CORRAL_API_KEY`` (an org key) is used instead of
any admin token when it is set.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from corral.shared.settings import ClientSettings

API_URL_FILE = "api-url"
ADMIN_TOKEN_FILE = "admin-token"  # noqa: S105 - a file name, not a secret
FROM_HOST_PORT = "CORRAL_API_HOST/PORT"  # the URL's source when nothing named an api


@dataclass(frozen=True)
class ApiTarget:
    url: str
    token: str | None
    url_from: str  # where the URL came from, for messages


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def api_target(settings: ClientSettings) -> ApiTarget:
    """The api URL and the token (an org key, or the admin token) this process should use."""
    url_file = settings.state_dir / API_URL_FILE
    if settings.api_url:
        url, source = settings.api_url, "CORRAL_API_URL"
    elif (found := _read(url_file)) is not None:
        url, source = found, str(url_file)
    else:
        url, source = f"http://{settings.api_host}:{settings.api_port}", FROM_HOST_PORT
    if settings.api_key is not None:
        token: str | None = settings.api_key.get_secret_value()
    elif settings.admin_token is not None:
        token = settings.admin_token.get_secret_value()
    else:
        token = _read(settings.state_dir / ADMIN_TOKEN_FILE)
    return ApiTarget(url.rstrip("/"), token, source)


def write_owner_only(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by its owner only, at once: a
    reader sees the whole file or none (another command reads it while ``corral dev``
    starts), never an empty one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    making = path.with_name(f".{path.name}.{os.getpid()}.making")
    try:
        with os.fdopen(os.open(making, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write(text + "\n")
        making.chmod(0o600)  # also when it was left with wider permissions
        os.replace(making, path)
    finally:
        making.unlink(missing_ok=True)  # nothing left beside it, whatever failed


def publish(state_dir: Path, url: str, token: str) -> None:
    """What ``corral dev`` leaves for the other commands: its api URL and admin token."""
    write_owner_only(state_dir / ADMIN_TOKEN_FILE, token)
    write_owner_only(state_dir / API_URL_FILE, url)


def withdraw(state_dir: Path, url: str) -> None:
    """Remove the api URL file when it still names ``url`` (another dev may have taken it)."""
    path = state_dir / API_URL_FILE
    if _read(path) == url:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address) is this host's loopback."""
    try:
        return host == "localhost" or ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def api_answers(target: ApiTarget, *, timeout_s: float = 1.0) -> bool:
    """Whether an api answers ``GET /healthz`` at the target's URL."""
    if not target.url.startswith(("http://", "https://")):
        return False
    try:
        with urllib.request.urlopen(f"{target.url}/healthz", timeout=timeout_s) as answer:  # noqa: S310 - http(s) only, checked above
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
