"""The task command router of the Modal stand-in: the SDK's own generated
``TaskCommandRouter`` service, which ``Sandbox.exec`` talks to directly (on Modal, on the
worker that runs the sandbox) with the JWT ``TaskGetCommandRouterAccess`` handed out. Each
exec'd command runs as a local process with its sandbox's environment, in its directory."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

from google.protobuf.message import Message
from grpclib import GRPCError, Status
from grpclib.server import Stream
from modal_proto import task_command_router_pb2 as sr_pb2
from modal_proto.task_command_router_grpc import TaskCommandRouterBase

from tests.standins.modal_api import Gate, fill_unimplemented
from tests.standins.modal_state import ExecRun, StandinSandbox, kill_group

CHUNK = 64 * 1024


def _check_jwt(gate: Gate, stream: Stream[Any, Any], task_id: str) -> None:
    given = str(stream.metadata.get("authorization", ""))
    with gate.state.lock:
        expected = gate.state.jwts.get(task_id)
    if expected is None or given != f"Bearer {expected}":
        raise GRPCError(Status.UNAUTHENTICATED, "invalid or missing command router JWT")


async def _receive(gate: Gate, method: str, stream: Stream[Any, Any]) -> Any:
    request = await stream.recv_message()
    assert request is not None
    await gate.enter(method, stream, request)
    _check_jwt(gate, stream, request.task_id)
    return request


@fill_unimplemented
class TaskRouter(TaskCommandRouterBase):
    """Exec: start, read stdout/stderr from an offset, poll and wait for the exit."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.state = gate.state

    async def TaskExecStart(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(self.gate, "TaskExecStart", stream)
        sandbox = self._running(request.task_id)
        env = dict(sandbox.env)
        for source in request.secret_sources:
            if source.secret_id:
                env.update(self.state.secrets.get(source.secret_id, {}))
            env.update(dict(source.env.contents))
        env.update({entry.key: entry.value for entry in request.env})
        with self.state.lock:
            if request.exec_id not in self.state.execs:  # the exec id is its idempotency key
                self.state.execs[request.exec_id] = self._start(sandbox, request, env)
        await stream.send_message(sr_pb2.TaskExecStartResponse())

    def _running(self, task_id: str) -> StandinSandbox:
        with self.state.lock:
            found = [s for s in self.state.sandboxes.values() if s.task_id == task_id]
            if not found:
                raise GRPCError(Status.NOT_FOUND, f"task {task_id} not found")
            self.state.refresh(found[0])
            if found[0].result is not None:
                raise GRPCError(Status.FAILED_PRECONDITION, f"task {task_id} has finished")
            return found[0]

    def _start(self, sandbox: StandinSandbox, request: Any, env: dict[str, str]) -> ExecRun:
        directory = sandbox.workdir / "execs"
        directory.mkdir(parents=True, exist_ok=True)
        stdout, stderr = directory / f"{request.exec_id}.out", directory / f"{request.exec_id}.err"
        argv = list(request.command_args)
        with stdout.open("wb") as out, stderr.open("wb") as err:
            try:
                process = subprocess.Popen(
                    argv,
                    cwd=sandbox.workdir,
                    env={**self.state.base_env, "HOME": str(sandbox.workdir), **env},
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:  # as a shell in the container would say it
                err.write(f"{argv[0]}: {exc.strerror}\n".encode())
                process = subprocess.Popen(["sh", "-c", "exit 127"], start_new_session=True)
        deadline = time.monotonic() + request.timeout_secs if request.timeout_secs else None
        return ExecRun(
            request.exec_id, sandbox.sandbox_id, argv, env, process, stdout, stderr, deadline
        )

    def _run(self, exec_id: str) -> ExecRun:
        with self.state.lock:
            run = self.state.execs.get(exec_id)
        if run is None:
            raise GRPCError(Status.NOT_FOUND, f"exec {exec_id} not found")
        if (
            run.deadline is not None
            and time.monotonic() > run.deadline
            and run.process.poll() is None
        ):
            run.timed_out = True
            kill_group(run.process)
        return run

    async def TaskExecStdioRead(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(self.gate, "TaskExecStdioRead", stream)
        run = self._run(request.exec_id)
        stdout = sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT
        path: Path = run.stdout if request.file_descriptor == stdout else run.stderr
        offset = request.offset
        while True:
            ended = self._run(request.exec_id).process.poll() is not None
            with path.open("rb") as source:
                source.seek(offset)
                data = source.read(CHUNK)
            if data:
                offset += len(data)
                await stream.send_message(sr_pb2.TaskExecStdioReadResponse(data=data))
            elif ended:
                return
            else:
                await asyncio.sleep(0.02)

    async def TaskExecPoll(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(self.gate, "TaskExecPoll", stream)
        await stream.send_message(
            self._exit(self._run(request.exec_id), sr_pb2.TaskExecPollResponse)
        )

    async def TaskExecWait(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(self.gate, "TaskExecWait", stream)
        run = self._run(request.exec_id)
        while run.process.poll() is None:
            await asyncio.sleep(0.02)
            run = self._run(request.exec_id)
        await stream.send_message(self._exit(run, sr_pb2.TaskExecWaitResponse))

    @staticmethod
    def _exit(run: ExecRun, answer: type[Message]) -> Message:
        code = run.process.poll()
        if code is None:
            return answer()
        if code < 0:
            return answer(signal=-code)
        return answer(code=code)

    async def TaskExecStdinWrite(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(self.gate, "TaskExecStdinWrite", stream)
        if request.data:  # stdin is /dev/null here; only the end of it is accepted
            raise GRPCError(Status.UNIMPLEMENTED, "the stand-in's exec has no stdin")
        await stream.send_message(sr_pb2.TaskExecStdinWriteResponse())
