"""The credential of a private git input: a named secret that corral's egress proxy puts into
the checkout's requests, and nothing else's.

A git input with ``secret`` becomes a checkout binding of the sandbox's egress: the
repository's host, its ``Authorization`` header (HTTP Basic: ``x-access-token`` and the
secret, or the secret as it is when it is ``user:password``), and the two requests of a
smart-HTTP fetch of that one repository (``GET <path>/info/refs?service=git-upload-pack``,
``POST <path>/git-upload-pack``: never a push). The proxy applies it inside TLS alone, and
only until the runner says the checkout is done; the host is reached for those requests
alone unless it is one of ``allowed_hosts`` (:mod:`corral.providers.egress.proxy`).
"""

from __future__ import annotations

import base64
from urllib.parse import urlsplit

from pydantic import SecretStr

from corral.providers.base import SecretBinding
from corral.shared.messages import GitInput, check_credential_line
from corral.shared.runtime import Runtime
from corral.shared.store import secrets
from corral.shared.store.secrets import SecretError

# The binding's name: no environment variable has it, so the sandbox gets none, and its
# placeholder is the one the runner names (corral.runner.egress.GIT_CREDENTIAL_PLACEHOLDER).
GIT_CREDENTIAL = "inputs.git"
DEFAULT_USER = "x-access-token"


def basic_credential(secret: str) -> str:
    """The ``Authorization`` value of ``secret``: a ``user:password`` secret as it is, any
    other the password of DEFAULT_USER."""
    pair = secret if ":" in secret else f"{DEFAULT_USER}:{secret}"
    return "Basic " + base64.b64encode(pair.encode()).decode("ascii")


def checkout_binding(git: GitInput, secret: str) -> SecretBinding:
    """The checkout binding of ``git`` (an https:// URL, as a message with a secret has)."""
    parts = urlsplit(git.url)
    path = parts.path.rstrip("/")
    return SecretBinding(
        host=parts.netloc if parts.port else f"{parts.netloc}:443",
        value=SecretStr(basic_credential(secret)),
        header="Authorization",
        checkout_requests=(
            ("GET", f"{path}/info/refs?service=git-upload-pack"),
            ("POST", f"{path}/git-upload-pack"),
        ),
    )


def git_credential(
    rt: Runtime, item: tuple[str, str], git: GitInput | None
) -> SecretBinding | None:
    """The checkout binding of the item's git input (``item``: its id and org), its named
    secret read now and its use recorded; None when it names no secret.

    Raises:
        UnknownSecretError: the secret is gone (deleted since the dispatch).
        SecretError: its value cannot be a credential (too long, or not one line).
        ConfigurationError: it cannot be opened here.
    """
    if git is None or git.secret is None:
        return None
    with rt.db.session() as session:
        keyring, used_in = rt.db.sealer.keyring, secrets.UsedIn.GIT
        value = secrets.resolve_for_item(session, keyring, item, {"git": git.secret}, used_in)
        try:
            check_credential_line(value["git"])
        except ValueError as exc:
            # Raised in the transaction: it is rolled back, no use recorded.
            raise SecretError(
                f"inputs.git.secret: the named secret {git.secret} cannot be a git "
                f"credential: {exc}"
            ) from exc
    return checkout_binding(git, value["git"])
