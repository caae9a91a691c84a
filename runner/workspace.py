"""The workspace's input and its result bundle.

Between install and post_acquire the runner checks out the claim's git input (if any) into
the workspace (its working directory) and, when the claim asks for a bundle, takes the
workspace's snapshot: the base the bundle is made against. After the work it builds the
bundle and uploads it, before completion is reported.
"""

from __future__ import annotations

import os
import subprocess

from .control import ControlClient
from .diagnostics import logger
from .egress import GIT_CREDENTIAL_PLACEHOLDER, finish_checkout
from .errors import ControlError
from .phases import StepContext
from .protocol import BUNDLE_TOO_LARGE, Claim, Completion, GitInput
from .records import field, record, replace
from .steps import LineSink

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import Any

    from .bundle import Bundle
    from .snapshot import Snapshot


# git never prompts for credentials (there is no one to answer) nor opens an editor.
GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "GIT_EDITOR": "true"}
INPUT_FAILED_EXIT_CODE = 1


@record(frozen=False)
class Workspace:
    """One claim's workspace: ``root`` is the runner's working directory."""

    claim: Claim
    root: str = field(default_factory=os.getcwd)
    base: Snapshot | None = None
    base_info: dict[str, Any] = field(default_factory=lambda: {"kind": "workspace"})

    def prepare(self, context: StepContext) -> Completion | None:
        """Check out the input, then take the snapshot; the completion of a failure."""
        if self.claim.git_input is not None:
            failed = self._check_out(self.claim.git_input, context)
            if failed is not None:
                return failed
        if self.claim.bundle is not None:
            context.sink("system", "taking the workspace's snapshot for the result bundle")
            # Imported here, as in finish: most items collect no bundle, and every runner
            # would pay for loading tarfile and hashlib at its start.
            from .snapshot import take_snapshot  # noqa: PLC0415

            self.base = take_snapshot(self.root, keep_texts=True)
        return None

    def _check_out(self, git: GitInput, context: StepContext) -> Completion | None:
        import shutil  # noqa: PLC0415 - only a git input needs it (see prepare)

        if shutil.which("git", path=context.env.get("PATH")) is None:
            return _input_failed(
                context.sink,
                "git is not installed in the sandbox; use an image that has it, or install "
                "it with toolchain.install_commands",
            )
        context.sink("system", f"input: checking out {git.ref} of {git.url}")
        steps = (
            ("init", ["git", "init", "-q", "."]),
            ("fetch", fetch_argv(git)),
            (
                "checkout",
                ["git", "-c", "advice.detachedHead=false", "checkout", "-q", "FETCH_HEAD"],
            ),
        )
        for name, argv in steps:
            outcome = context.run_argv(argv, env=GIT_ENV)
            # Fetched or not, the credential is withdrawn before anything else runs.
            unwithdrawn = _withdraw_credential(git, context.sink) if name == "fetch" else None
            if outcome.interrupted is not None:
                return context.interrupted(outcome.interrupted, "input")
            if outcome.returncode != 0:
                return _input_failed(
                    context.sink,
                    f"`git {name}` failed with exit code {outcome.returncode} while checking "
                    f"out {git.ref} of {git.url} (its output is in the log)",
                )
            if unwithdrawn is not None:
                return unwithdrawn
        self.base_info = {"kind": "git", "url": git.url, "ref": git.ref, "commit": _head()}
        return None

    def finish(self, completion: Completion, session: ControlClient, sink: LineSink) -> Completion:
        """Build and upload the bundle; ``completion``, failed ``bundle_too_large`` when the
        changes are over a limit (and the work had succeeded)."""
        if self.base is None or self.claim.bundle is None:
            return completion
        if completion.cancelled:  # the item is over, and the sandbox may be going: no bundle
            sink("system", "bundle: not collected, the work was cancelled")
            return completion
        import tarfile  # noqa: PLC0415 - see prepare

        from .bundle import BundleTooLargeError, build_bundle  # noqa: PLC0415

        try:
            bundle = build_bundle(self.base, base_info=self.base_info, limits=self.claim.bundle)
        except BundleTooLargeError as error:
            return _too_large(completion, str(error), sink)
        except (OSError, tarfile.TarError) as error:  # e.g. a file vanished while it was read
            logger.exception("could not build the bundle")
            return _bundle_failed(completion, f"could not build the bundle: {error}", sink)
        try:
            return _upload(bundle, completion, session, sink)
        finally:
            os.unlink(bundle.path)


def _upload(
    bundle: Bundle, completion: Completion, session: ControlClient, sink: LineSink
) -> Completion:
    for refused in bundle.refused:
        sink("system", f"bundle: left out {refused.path}: {refused.reason}")
    sink("system", f"bundle: {bundle.changes} changes, {bundle.content_bytes} bytes")
    try:
        session.upload_bundle(bundle.path)
    except ControlError as error:
        if error.status == 413:
            return _too_large(completion, f"the api refused the bundle: {error}", sink)
        logger.error("could not upload the bundle: %s", error)
        return _bundle_failed(completion, f"could not upload the bundle: {error}", sink)
    return completion


def _too_large(completion: Completion, message: str, sink: LineSink) -> Completion:
    sink("system", f"bundle: {message}")
    if not completion.succeeded:
        return completion  # the work's own failure is what the item reports
    return replace(completion, error=message, error_code=BUNDLE_TOO_LARGE)


def _bundle_failed(completion: Completion, message: str, sink: LineSink) -> Completion:
    sink("system", message)
    if not completion.succeeded:
        return completion
    return replace(completion, exit_code=1, error=message)


def _input_failed(sink: LineSink, message: str) -> Completion:
    sink("system", message)
    return Completion(INPUT_FAILED_EXIT_CODE, "input", error=message)


def fetch_argv(git: GitInput) -> list[str]:
    """The command that fetches the input's ref. With a credential, git sends its
    placeholder in an Authorization header, which corral's egress proxy replaces for the
    checkout's requests: the value is in no argument, file or variable of the sandbox."""
    options = []
    if git.credential:
        options = ["-c", f"http.extraHeader=Authorization: {GIT_CREDENTIAL_PLACEHOLDER}"]
    return ["git", *options, "fetch", "-q", "--no-tags", "--", git.url, git.ref]


def _withdraw_credential(git: GitInput, sink: LineSink) -> Completion | None:
    """Have the proxy withdraw the input's credential (a latch); the completion of a
    failure to: the work never runs while the credential could still be used."""
    if not git.credential:
        return None
    try:
        finish_checkout(os.environ)
    except OSError as error:
        return _input_failed(sink, f"the checkout's credential could not be withdrawn: {error}")
    sink("system", "input: the checkout's credential is withdrawn")
    return None


def _head() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None
