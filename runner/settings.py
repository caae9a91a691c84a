"""The runner's settings, read from the environment the provider started it with."""

from __future__ import annotations

from collections.abc import MutableMapping

from .control import Endpoint
from .errors import ConfigurationError
from .identity import REGISTRATION_TOKEN_VARIABLE, take_registration_token
from .records import field, record

CONTROL_URL_VARIABLE = "CORRAL_CONTROL_URL"
SANDBOX_ID_VARIABLE = "CORRAL_SANDBOX_ID"


@record
class Settings:
    """Where the control plane is and the one-time token to register with."""

    endpoint: Endpoint
    registration_token: str = field(repr=False)
    sandbox_id: str | None = None

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str]) -> Settings:
        """Read the settings and remove the registration token from ``environ``.

        The token is ``CORRAL_REGISTRATION_TOKEN``, or what the pipe named by
        ``CORRAL_REGISTRATION_TOKEN_FD`` holds (see :mod:`.identity`). Both are removed first,
        even when the rest is invalid, so that no process the runner starts (they inherit
        ``os.environ``) ever sees the token.

        Raises:
            ConfigurationError: the control URL or the token is missing, or the URL invalid.
        """
        token = take_registration_token(environ)
        url = environ.get(CONTROL_URL_VARIABLE, "").strip()
        if not url:
            raise ConfigurationError(f"{CONTROL_URL_VARIABLE} is not set")
        if not token:
            raise ConfigurationError(f"{REGISTRATION_TOKEN_VARIABLE} is not set")
        return cls(
            endpoint=Endpoint.parse(url),
            registration_token=token,
            sandbox_id=environ.get(SANDBOX_ID_VARIABLE) or None,
        )
