"""The bodies the runner exchanges with the control plane, as frozen records.

The runner cannot use pydantic (standard library only), so this module is the boundary:
it checks each field of what the control plane sends and turns it into plain values, so
that nothing past it handles raw dicts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .errors import ProtocolError
from .records import field, record, replace

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import Any, Literal

    # "input": fetching the workspace's input (a git checkout), between install and
    # post_acquire.
    Phase = Literal["install", "input", "post_acquire", "work"]

SUPPORTED_LANGUAGES = ("python", "javascript")
# The control plane refuses longer errors; an error quoting a long command must still land.
MAX_ERROR_CHARS = 4000
DEFAULT_MAX_RESULT_BYTES = 1_000_000  # when the claim does not say
RESULT_TOO_LARGE = "result_too_large"
BUNDLE_TOO_LARGE = "bundle_too_large"
DEFAULT_MAX_BUNDLE_BYTES = 100_000_000
DEFAULT_MAX_MANIFEST_BYTES = 5_000_000
DEFAULT_MAX_PATCHES = 1000


@record
class BundleLimits:
    """What one result bundle may hold; its size counts its members' bytes, uncompressed."""

    max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES
    max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES
    max_patches: int = DEFAULT_MAX_PATCHES


@record
class Registration:
    """What ``/v1/runner/register`` grants: the session for every later call."""

    session_token: str = field(repr=False)
    sandbox_id: str
    work_item_id: str
    heartbeat_interval_s: float
    # The claim answer made with it (parse_claim reads it: it holds the work's env), or None:
    # the runner calls /claim.
    claim: Mapping[str, Any] | None = field(default=None, repr=False)


@record
class ShellWork:
    """A command for ``/bin/sh -c``."""

    command: str


@record
class CodeWork:
    """Source code defining ``main``: Python's is called with ``arguments`` as keyword
    arguments, JavaScript's with them as one object."""

    language: str
    code: str = field(repr=False)
    arguments: Mapping[str, Any] = field(default_factory=dict)


@record
class GitInput:
    """A repository to check out into the workspace before post_acquire. ``credential``:
    corral's egress proxy puts a named secret into the checkout's requests (the runner
    names its placeholder, and withdraws it once fetched)."""

    url: str
    ref: str
    credential: bool = False


@record
class ModelProfile:
    """The item's model profile (the work finds it in CORRAL_MODEL, CORRAL_PROFILE and
    CORRAL_AUTH_MODE too: the claim's env carries them)."""

    name: str
    model: str
    auth_mode: str


@record
class Claim:
    """The work item ``/v1/runner/claim`` hands over, with its toolchain steps."""

    work_item_id: str
    work: ShellWork | CodeWork
    install_commands: tuple[str, ...] = ()
    post_acquire: tuple[str, ...] = ()
    pre_release: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    bundle: BundleLimits | None = None  # None: the changes are not collected
    git_input: GitInput | None = None
    path: tuple[str, ...] = ()  # in front of PATH ($VAR expanded): the kits' directories
    profile: ModelProfile | None = None


@record
class Completion:
    """What ``/v1/runner/complete`` reports about the work phase."""

    exit_code: int
    phase: Phase
    result: Any = None
    error: str | None = None
    cancelled: bool = False
    duration_s: float = 0.0
    # RESULT_TOO_LARGE: the result was kept back; BUNDLE_TOO_LARGE: the changes were
    error_code: str | None = None

    @property
    def succeeded(self) -> bool:
        return (
            self.exit_code == 0
            and self.error is None
            and not self.cancelled
            and self.error_code is None
        )

    def within(self, max_result_bytes: int) -> Completion:
        """This completion, or, when its result is over ``max_result_bytes`` of JSON, the
        same without the result, failing ``result_too_large`` (sent, it would be refused)."""
        size = len(json.dumps(self.result))
        if size <= max_result_bytes:
            return self
        error = (
            f"the work's result is {size} bytes of JSON, more than the limit of "
            f"{max_result_bytes} bytes; return less (write large output to files or logs)"
        )
        return replace(self, result=None, error=error, error_code=RESULT_TOO_LARGE)

    def to_json(self) -> dict[str, Any]:
        body = {
            "exit_code": self.exit_code,
            "result": self.result,
            "duration_s": round(self.duration_s, 3),
            "error": _shorten(self.error),
            "phase": self.phase,
            "cancelled": self.cancelled,
        }
        if self.error_code is not None:
            body["error_code"] = self.error_code
        return body


def _shorten(error: str | None) -> str | None:
    if error is None or len(error) <= MAX_ERROR_CHARS:
        return error
    return error[: MAX_ERROR_CHARS - 15] + " [truncated]"


def parse_registration(body: Any) -> Registration:
    """Check the register answer.

    Raises:
        ProtocolError: a field is missing or has the wrong type.
    """
    body = _object(body, "registration")
    interval = _number(body, "heartbeat_interval_s")
    if interval is None or interval <= 0:
        raise ProtocolError("registration: heartbeat_interval_s must be a positive number")
    claim = body.get("claim")
    if claim is not None and not isinstance(claim, Mapping):
        raise ProtocolError("registration: claim must be an object or null")
    return Registration(
        session_token=_string(body, "session_token"),
        sandbox_id=_string(body, "sandbox_id"),
        work_item_id=_string(body, "work_item_id"),
        heartbeat_interval_s=interval,
        claim=claim,
    )


@record
class Enrolment:
    """What ``/v1/runner/enrol`` grants a warm runner: the channel it waits on."""

    channel_token: str = field(repr=False)
    sandbox_id: str
    wait_s: float


def parse_enrolment(body: Any) -> Enrolment:
    """Check the enrol answer.

    Raises:
        ProtocolError: a field is missing or has the wrong type.
    """
    body = _object(body, "enrolment")
    wait_s = _number(body, "wait_s")
    if wait_s is None or wait_s <= 0:
        raise ProtocolError("enrolment: wait_s must be a positive number")
    return Enrolment(
        channel_token=_string(body, "channel_token"),
        sandbox_id=_string(body, "sandbox_id"),
        wait_s=wait_s,
    )


def parse_warm_wait(body: Any) -> str | None:
    """The registration token a warm wait answered, or None (not bound yet).

    Raises:
        ProtocolError: not the answer's shape.
    """
    body = _object(body, "warm wait")
    token = body.get("registration_token")
    if token is not None and not isinstance(token, str):
        raise ProtocolError("warm wait: registration_token must be a string or null")
    return token or None


def parse_claim(body: Any) -> Claim:
    """Check the claim answer.

    Raises:
        ProtocolError: a field is missing, has the wrong type, or the work kind is unknown.
    """
    body = _object(body, "claim")
    timeout_s = _number(body, "timeout_s")
    if timeout_s is not None and timeout_s <= 0:
        raise ProtocolError("claim: timeout_s must be a positive number or null")
    return Claim(
        work_item_id=_string(body, "work_item_id"),
        work=_parse_work(body.get("work")),
        install_commands=_strings(body, "install_commands"),
        post_acquire=_strings(body, "post_acquire"),
        pre_release=_strings(body, "pre_release"),
        env=_string_map(body, "env"),
        timeout_s=timeout_s,
        max_result_bytes=_limit(body, "max_result_bytes", DEFAULT_MAX_RESULT_BYTES),
        bundle=_bundle_limits(body.get("bundle")),
        git_input=_git_input(body.get("inputs")),
        path=_strings(body, "path"),
        profile=_profile(body.get("profile")),
    )


def _profile(value: Any) -> ModelProfile | None:
    if value is None:
        return None
    body = _object(value, "profile")
    return ModelProfile(
        name=_string(body, "name"),
        model=_string(body, "model"),
        auth_mode=_string(body, "auth_mode"),
    )


def _bundle_limits(value: Any) -> BundleLimits | None:
    if value is None:
        return None
    body = _object(value, "bundle")
    return BundleLimits(
        max_bytes=_limit(body, "max_bytes", BundleLimits.max_bytes),
        max_manifest_bytes=_limit(body, "max_manifest_bytes", BundleLimits.max_manifest_bytes),
        max_patches=_limit(body, "max_patches", BundleLimits.max_patches),
    )


def _git_input(value: Any) -> GitInput | None:
    if value is None:
        return None
    git = _object(value, "inputs").get("git")
    if git is None:
        return None
    body = _object(git, "inputs.git")
    secret = body.get("secret")
    if secret is not None and not isinstance(secret, str):
        raise ProtocolError("claim: inputs.git.secret must be a string")
    return GitInput(url=_string(body, "url"), ref=_string(body, "ref"), credential=bool(secret))


def _limit(body: Mapping[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProtocolError(f"claim: {name} must be a positive integer")
    return value


def _parse_work(value: Any) -> ShellWork | CodeWork:
    body = _object(value, "work")
    kind = body.get("kind")
    if kind == "shell":
        return ShellWork(command=_string(body, "command"))
    if kind == "code":
        arguments = body.get("arguments") or {}
        if not isinstance(arguments, dict) or not all(isinstance(k, str) for k in arguments):
            raise ProtocolError("work.arguments must be an object")
        return CodeWork(
            language=_string(body, "language"), code=_string(body, "code"), arguments=arguments
        )
    raise ProtocolError(f"unsupported work kind {kind!r}; supported: shell, code")


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _string(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{key} must be a string")
    return value


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int to Python, but never a duration.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{key} must be a number")
    return float(value)


def _strings(body: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ProtocolError(f"{key} must be a list of strings")
    return tuple(value)


def _string_map(body: Mapping[str, Any], key: str) -> dict[str, str]:
    value = body.get(key) or {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ProtocolError(f"{key} must be an object of strings")
    return dict(value)
