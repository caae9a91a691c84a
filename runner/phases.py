"""The phases of a claimed work item: install, post_acquire and the work, then pre_release.

Install and post_acquire steps prepare the sandbox; the first one that fails aborts, and
the work does not run. The three share one wall-clock limit, the claim's ``timeout_s``.
pre_release runs after completion was reported, best-effort.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence

from .diagnostics import logger
from .memory import MemoryWatch
from .protocol import Claim, CodeWork, Completion, ShellWork
from .records import record, replace
from .steps import Cancellation, LineSink, StepOutcome, run_step

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from .protocol import Phase
    from .steps import Interruption

SHELL = "/bin/sh"
TIMEOUT_EXIT_CODE = 124  # what coreutils' timeout(1) exits with
CANCELLED_EXIT_CODE = -signal.SIGTERM
UNSUPPORTED_EXIT_CODE = 2


@record
class StepContext:
    """What every step of one work phase shares."""

    env: Mapping[str, str]
    sink: LineSink
    cancellation: Cancellation
    deadline: float | None
    timeout_s: float | None

    def run(self, command: str) -> StepOutcome:
        return self.run_argv([SHELL, "-c", command])

    def run_argv(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> StepOutcome:
        return run_step(
            argv,
            env={**self.env, **(env or {})},
            sink=self.sink,
            cancellation=self.cancellation,
            deadline=self.deadline,
        )

    def interrupted(self, interruption: Interruption, phase: Phase) -> Completion:
        """The completion of a phase the runner stopped."""
        if interruption == "timed_out":
            timeout = f"{self.timeout_s:g}s" if self.timeout_s is not None else "its deadline"
            return Completion(TIMEOUT_EXIT_CODE, phase, error=f"timed out after {timeout}")
        return Completion(
            CANCELLED_EXIT_CODE, phase, error=self.cancellation.reason, cancelled=True
        )


# Run between install and post_acquire (the workspace's input and its snapshot); a
# completion when it failed.
WorkspaceStep = Callable[[StepContext], "Completion | None"]


def run_work_phase(
    claim: Claim,
    *,
    base_env: Mapping[str, str],
    sink: LineSink,
    cancellation: Cancellation,
    prepare_workspace: WorkspaceStep | None = None,
) -> Completion:
    """Run install, the workspace step, post_acquire and the work; report how far it got
    and how it ended."""
    started = time.monotonic()
    memory = MemoryWatch()
    context = StepContext(
        env=with_path({**base_env, **claim.env}, claim.path),
        sink=memory.sink(sink),
        cancellation=cancellation,
        deadline=None if claim.timeout_s is None else started + claim.timeout_s,
        timeout_s=claim.timeout_s,
    )
    completion = _prepare(claim, context, prepare_workspace) or _work(claim.work, context)
    completion = memory.judge(completion)
    return replace(completion, duration_s=time.monotonic() - started)


_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def with_path(env: Mapping[str, str], path: tuple[str, ...]) -> dict[str, str]:
    """``env`` with ``path``'s directories in front of its PATH, their ``$VAR`` and
    ``${VAR}`` taken from ``env`` itself (an unset one makes the directory go)."""
    directories = []
    for entry in path:
        names = [a or b for a, b in _VARIABLE.findall(entry)]
        if all(env.get(name) for name in names):
            directories.append(_VARIABLE.sub(lambda m: env[m.group(1) or m.group(2)], entry))
    if not directories:
        return dict(env)
    return {**env, "PATH": ":".join([*directories, env.get("PATH", "/usr/bin:/bin")])}


def _prepare(
    claim: Claim, context: StepContext, prepare_workspace: WorkspaceStep | None
) -> Completion | None:
    """Run install steps, the workspace step, then post_acquire steps; the completion of the
    first failure, if any."""
    failed = _steps("install", claim.install_commands, context)
    if failed is None and prepare_workspace is not None:
        failed = prepare_workspace(context)
    return failed or _steps("post_acquire", claim.post_acquire, context)


def _steps(phase: Phase, commands: tuple[str, ...], context: StepContext) -> Completion | None:
    for number, command in enumerate(commands, start=1):
        context.sink("system", f"{phase} step {number}: {command}")
        outcome = context.run(command)
        if outcome.interrupted is not None:
            return context.interrupted(outcome.interrupted, phase)
        if outcome.returncode != 0:
            error = f"{phase} step {number} failed with exit code {outcome.returncode}: {command}"
            context.sink("system", error)
            return Completion(outcome.returncode, phase, error=error)
    return None


def _work(work: ShellWork | CodeWork, context: StepContext) -> Completion:
    if isinstance(work, ShellWork):
        context.sink("system", f"work: {work.command}")
        outcome = context.run(work.command)
        if outcome.interrupted is not None:
            return context.interrupted(outcome.interrupted, "work")
        error = None
        if outcome.returncode != 0:
            error = f"work failed with exit code {outcome.returncode}"
        return Completion(outcome.returncode, "work", error=error)
    # Imported here: a shell item's runner never loads what running code needs.
    from .python_code import run_code, unsupported_language_error  # noqa: PLC0415

    unsupported = unsupported_language_error(work)
    if unsupported is not None:
        return Completion(UNSUPPORTED_EXIT_CODE, "work", error=unsupported)
    call = "main(**arguments)" if work.language == "python" else "main(arguments)"
    context.sink("system", f"work: {work.language} code, {call}")
    code = run_code(
        work,
        env=context.env,
        sink=context.sink,
        cancellation=context.cancellation,
        deadline=context.deadline,
    )
    if code.step.interrupted is not None:
        return context.interrupted(code.step.interrupted, "work")
    return Completion(code.step.returncode, "work", result=code.result, error=code.error)


def run_pre_release(
    claim: Claim,
    *,
    base_env: Mapping[str, str],
    sink: LineSink,
    cancellation: Cancellation,
) -> None:
    """Run pre_release steps best-effort: a failure is noted, and the next step still runs."""
    env = {**base_env, **claim.env}
    for number, command in enumerate(claim.pre_release, start=1):
        sink("system", f"pre_release step {number}: {command}")
        outcome = run_step([SHELL, "-c", command], env=env, sink=sink, cancellation=cancellation)
        if outcome.interrupted is not None:
            logger.warning("pre_release stopped: %s", cancellation.reason)
            sink("system", f"pre_release stopped: {cancellation.reason}")
            return
        if outcome.returncode != 0:
            note = f"pre_release step {number} failed with exit code {outcome.returncode}"
            logger.warning("%s", note)
            sink("system", note)
