"""Where the client finds the api and its token.

Precedence: the arguments given, then ``CORRAL_API_URL`` and ``CORRAL_API_KEY`` (an org key)
or ``CORRAL_ADMIN_TOKEN``, then the files ``corral dev`` leaves in its state directory
(``<CORRAL_STATE_DIR>/api-url`` and ``admin-token``), as the ``corral`` commands read them
(:mod:`corral.cli.api_target`). An api URL may be ``unix:///path/to/api.sock``: the api's
Unix socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from corral.cli.api_target import api_target
from corral.client.errors import ClientConfigError
from corral.shared.settings import ClientSettings

UNIX = "unix://"
# The host name requests carry over a Unix socket (the api reads no Host).
SOCKET_BASE = "http://corral"


@dataclass(frozen=True)
class Target:
    """The api to call and the bearer token to call it with."""

    url: str
    token: str = field(repr=False)  # an org key or the admin token: never in a repr

    @property
    def socket(self) -> str | None:
        """The Unix socket's path, for a ``unix://`` URL."""
        return self.url.removeprefix(UNIX) if self.url.startswith(UNIX) else None

    @property
    def base_url(self) -> str:
        """What requests' URLs start with."""
        return SOCKET_BASE if self.socket is not None else self.url.rstrip("/")


def find_target(api_url: str | None = None, token: str | None = None) -> Target:
    """The api and token: the arguments, else the environment, else ``corral dev``'s files.

    Raises:
        ClientConfigError: no token anywhere, or a ``unix://`` URL without an absolute path.
    """
    if api_url is None or token is None:
        found = api_target(ClientSettings())
        api_url = api_url or found.url
        token = token or found.token
    if not token:
        raise ClientConfigError(
            f"no token for the api at {api_url}: pass token=, or set CORRAL_API_KEY (an org "
            "key) or CORRAL_ADMIN_TOKEN, or run `corral dev` (it leaves one in its state dir)"
        )
    if api_url.startswith(UNIX) and not api_url.removeprefix(UNIX).startswith("/"):
        raise ClientConfigError(f"{api_url!r}: a unix URL needs an absolute path, unix:///path")
    return Target(api_url, token)


def sync_transport(target: Target) -> httpx.BaseTransport | None:
    """The Unix socket's transport for a ``unix://`` target; None: httpx's own."""
    return httpx.HTTPTransport(uds=target.socket) if target.socket is not None else None


def async_transport(target: Target) -> httpx.AsyncBaseTransport | None:
    """:func:`sync_transport` for ``httpx.AsyncClient``."""
    return httpx.AsyncHTTPTransport(uds=target.socket) if target.socket is not None else None
