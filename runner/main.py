"""The runner's flow: register, claim, run the work item, report it, then pre_release.

Exit codes, informative only (the control plane learns the outcome from ``complete``):
0 the work succeeded, 1 it failed, 2 configuration missing or invalid, 3 registration
refused, 4 the work item was already claimed, 5 the control plane unreachable or
incoherent.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from .control import ControlClient
from .diagnostics import configure_logging, logger
from .egress import install_ca_bundle, start_forwarder
from .errors import (
    ConfigurationError,
    ConflictError,
    ProtocolError,
    RunnerError,
    UnauthorizedError,
)
from .heartbeat import Heartbeat
from .identity import ENROLMENT_PREFIX
from .logs import LogShipper
from .phases import UNSUPPORTED_EXIT_CODE, run_pre_release, run_work_phase
from .protocol import Claim, Completion, Registration, parse_claim
from .records import replace
from .settings import Settings
from .steps import Cancellation
from .work_env import WorkEnvError, take_work_env
from .workspace import Workspace

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import Any

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_CONFIGURATION = 2
EXIT_REFUSED = 3
EXIT_CONFLICT = 4
EXIT_CONTROL_PLANE = 5

TERMINATED = "the runner received SIGTERM: the sandbox is being stopped"


def main() -> int:
    """Run the work item this sandbox was started for; the process's exit code."""
    configure_logging()
    try:
        # The work's variables, handed over inside the sandbox (never the environment of a
        # host process): before anything reads the environment.
        take_work_env(os.environ)
        settings = Settings.from_environment(os.environ)
    except (WorkEnvError, ConfigurationError) as error:
        logger.error("%s", error)
        return EXIT_CONFIGURATION
    try:
        # Before any command runs: the work's commands reach the network through it.
        start_forwarder(os.environ)
    except OSError as error:
        logger.error("the egress proxy's local port could not be opened: %s", error)
        return EXIT_CONFIGURATION
    install_ca_bundle(os.environ)
    client = ControlClient(settings.endpoint)
    token = settings.registration_token
    if token.startswith(ENROLMENT_PREFIX):
        waited = _wait_for_item(client, token)
        if isinstance(waited, int):
            return waited
        token = waited
    try:
        registration = client.register(token, claim=True)
    except UnauthorizedError:
        logger.error("registration refused: token invalid, used or expired")
        return EXIT_REFUSED
    except RunnerError as error:
        logger.error("registration failed: %s", error)
        return EXIT_CONTROL_PLANE
    logger.info(
        "registered: sandbox %s, work item %s",
        registration.sandbox_id,
        registration.work_item_id,
    )
    return _claim_and_run(client.with_session(registration.session_token), registration)


def _wait_for_item(client: ControlClient, enrolment: str) -> str | int:
    """A warm runner: enrol, then wait on the channel until the control plane binds a work
    item to this sandbox; the item's registration token, or the exit code."""
    try:
        enrolled = client.enrol(enrolment)
    except UnauthorizedError:
        logger.error("enrolment refused: credential invalid or used, or the sandbox ended")
        return EXIT_REFUSED
    except RunnerError as error:
        logger.error("enrolment failed: %s", error)
        return EXIT_CONTROL_PLANE
    logger.info("warm sandbox %s enrolled: waiting for a work item", enrolled.sandbox_id)
    # Each wait is held by the api for up to wait_s: the call's own timeout is longer.
    channel = replace(client, timeout_s=enrolled.wait_s + client.timeout_s).with_session(
        enrolled.channel_token
    )
    while True:
        try:
            token = channel.warm_wait()
        except UnauthorizedError:
            logger.error("the warm channel was closed: the sandbox is ending")
            return EXIT_REFUSED
        except RunnerError as error:
            logger.error("waiting for a work item failed: %s", error)
            return EXIT_CONTROL_PLANE
        if token is not None:
            logger.info("a work item was bound to this sandbox")
            return token


def _claim_and_run(control: ControlClient, registration: Registration) -> int:
    try:
        # Claimed with the registration, or (that could not be done then) asked apart.
        claimed = registration.claim
        claim = control.claim() if claimed is None else parse_claim(claimed)
    except ConflictError as error:
        # Claimed by another runner, or ended (the answer says why, e.g. secret_key_mismatch).
        logger.error("work item %s cannot be claimed: %s", registration.work_item_id, error)
        return EXIT_CONFLICT
    except ProtocolError as error:
        # Registered, with its runner token: the control plane can still hear why.
        logger.error("the claimed work item is not understood: %s", error)
        completion = Completion(UNSUPPORTED_EXIT_CODE, "work", error=f"malformed claim: {error}")
        return _report(control, completion, [])
    except RunnerError as error:
        logger.error("claim failed: %s", error)
        return EXIT_CONTROL_PLANE
    return _run(control, registration, claim)


def _run(control: ControlClient, registration: Registration, claim: Claim) -> int:
    """Run the work phase under heartbeats, report it, then run pre_release."""
    shipper = LogShipper(control.send_logs)
    shipper.start()
    cancellation = Cancellation()
    _cancel_on_sigterm(cancellation)
    heartbeat = Heartbeat(
        control, interval_s=registration.heartbeat_interval_s, cancellation=cancellation
    )
    heartbeat.start()
    workspace = Workspace(claim)
    try:
        completion = _work_phase(claim, workspace, shipper, cancellation)
        completion = workspace.finish(
            completion.within(claim.max_result_bytes), control, shipper.emit
        )
        summary = _summary(completion)
        logger.info("%s", summary)
        shipper.emit("system", summary)
        code = _report(control, completion, shipper.take_final())
    finally:
        heartbeat.stop()
    if cancellation.reason == TERMINATED:
        logger.warning("skipping pre_release: the sandbox is being stopped")
    else:
        # A new cancellation: a cancelled work phase must not stop pre_release at once.
        release_cancellation = Cancellation()
        _cancel_on_sigterm(release_cancellation)
        run_pre_release(
            claim, base_env=dict(os.environ), sink=shipper.emit, cancellation=release_cancellation
        )
    shipper.close()
    return code


def _work_phase(
    claim: Claim, workspace: Workspace, shipper: LogShipper, cancellation: Cancellation
) -> Completion:
    """The work phase's completion; a bug in the runner is reported too, not only raised."""
    try:
        return run_work_phase(
            claim,
            base_env=dict(os.environ),
            sink=shipper.emit,
            cancellation=cancellation,
            prepare_workspace=workspace.prepare,
        )
    except Exception as error:
        logger.exception("the runner failed while running the work item")
        return Completion(EXIT_FAILED, "work", error=f"the runner failed: {error!r}")


def _report(control: ControlClient, completion: Completion, lines: list[dict[str, Any]]) -> int:
    """Post the completion, carrying the work's last log ``lines``; the runner's exit code
    for it."""
    try:
        control.complete(completion, lines)
    except RunnerError as error:
        logger.error("could not report completion: %s", error)
        return EXIT_CONTROL_PLANE
    return EXIT_SUCCEEDED if completion.succeeded else EXIT_FAILED


def _summary(completion: Completion) -> str:
    if completion.succeeded:
        return f"succeeded in {completion.duration_s:.1f}s"
    return (
        f"{completion.phase} ended with exit code {completion.exit_code} "
        f"after {completion.duration_s:.1f}s: {completion.error}"
    )


def _cancel_on_sigterm(cancellation: Cancellation) -> None:
    """SIGTERM (the sandbox is being stopped) cancels the running step instead of orphaning it.

    Steps run in their own process groups, so a TERM sent to the runner's group does not
    reach them; the runner stops them, and still reports, within the provider's grace.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may install signal handlers

    def on_term(signum: int, frame: FrameType | None) -> None:
        cancellation.cancel(TERMINATED)

    signal.signal(signal.SIGTERM, on_term)
