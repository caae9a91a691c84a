"""The docker provider: one container per sandbox on a Docker Engine (docker SDK).

The container gets the spec's environment, the registration token and the control URL and
nothing of the worker's own environment. Without network (``allow_network=false``) it runs
with network mode ``none`` and the api's Unix socket is mounted in, so the runner reaches
the control plane at ``unix://...``; with network, the mode comes from the configuration.
Containers carry corral's labels, and ``list_managed`` finds them by label, limited to this
deployment's (``corral.deployment``), so several deployments can share one engine.

The timeout becomes a deadline label; ``status`` stops a container that outlives it and
reports it failed. Terminate stops with a grace period, then removes; a missing container
counts as done.

``runtime`` picks the engine's OCI runtime for the containers, e.g. ``runsc`` (gVisor), which
the engine must have registered. A runtime that is not registered, or that fails to start
the container, is a permanent error with the engine's message: retrying cannot fix it.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import socket
import tarfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from corral.providers.base import (
    DEFAULT_DOWNLOAD_MAX_BYTES,
    DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    Capacity,
    ExecResult,
    ManagedSandbox,
    ProviderHealth,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    exit_status,
)
from corral.providers.configs.docker import (
    TOOL_CACHE_MOUNT,
    DockerProviderConfig,
    DockerProviderOptions,
    is_root_user,
)
from corral.providers.descriptors import BUILTIN
from corral.providers.docker.streams import copy_out, exec_bounded
from corral.providers.egress.plan import HostProxies
from corral.providers.errors import (
    CapacityExhaustedError,
    CredentialRejectedError,
    InvalidProviderConfigError,
    PermanentProviderError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
    SandboxVerificationError,
)
from corral.providers.local.isolation import SANDBOX_PROXY_DIR
from corral.providers.size_limits import log_tail
from corral.providers.vendor import StatusAnswer, status_answer

WORKDIR = "/work"
DEPLOYMENT_LABEL = "corral.deployment"
DEADLINE_LABEL = "corral.deadline"
KILLED_EXIT = 137  # 128 + SIGKILL
# Container summaries' State, as far as a listing can tell; status() has the exit details.
_LISTED_STATES = {
    "created": SandboxState.PROVISIONING,
    "running": SandboxState.RUNNING,
    "restarting": SandboxState.RUNNING,
    "paused": SandboxState.READY,
    "exited": SandboxState.FAILED,
    "dead": SandboxState.FAILED,
}


def _bounded_log(max_mb: int) -> dict[str, Any]:
    """The engine's log of a container within ``max_mb``: json-file (what ``docker logs`` and
    the end log read), in two files of half each, the older dropped as the newer fills, so
    that the end of the output is always there."""
    return {"type": "json-file", "config": {"max-size": f"{max_mb * 512}k", "max-file": "2"}}


def _owner_options(user: str) -> str:
    """tmpfs options that give the work directory to ``user``.

    (The engine ignores ``mode=`` on a tmpfs over the image's working directory.)
    """
    uid, _, gid = user.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        return ",mode=1777"  # a user name: the engine cannot map it here
    return f",uid={uid},gid={gid or uid}"


# How an engine words a runtime's failure: the OCI runtime failed to create or start the
# container ("OCI runtime create failed: ...", "OCI runtime start failed: ...", an HTTP 500
# when the runtime itself failed, a 400 when the container's command is not there), or the
# container names a runtime the engine does not have (a 400 to the create; Docker 20.10 says
# "Unknown runtime specified", later releases "unknown or invalid runtime name").
_UNKNOWN_RUNTIME = ("unknown runtime specified", "unknown or invalid runtime name")
_RUNTIME_FAILURES = ("oci runtime", *_UNKNOWN_RUNTIME)
RUNTIME_MESSAGE_LIMIT = 1000  # the runtime's own words are the useful part: keep them whole


def runtime_failure(error: docker.errors.APIError) -> bool:
    """Whether the engine's error is the container runtime's failure, not the engine's own
    trouble: retrying the same container on the same engine cannot help."""
    return _mentions(error, _RUNTIME_FAILURES)


def engine_answer(error: docker.errors.APIError) -> StatusAnswer:
    """The one status table's answer (:data:`corral.providers.vendor.STATUS_ANSWERS`) to the
    engine's error; no status (the engine's connection broke mid-answer) is transient."""
    return status_answer(error.status_code or 500)


def engine_trouble(error: docker.errors.APIError) -> bool:
    """Whether the engine's error is not the request's refusal but may pass (a transient
    answer that is not the runtime's failure) or is the engine refusing corral's access:
    either way the caller does not judge it; :func:`_engine_errors` does."""
    answer = engine_answer(error)
    if answer is StatusAnswer.CREDENTIAL_REJECTED:
        return True
    return answer is StatusAnswer.TRANSIENT and not runtime_failure(error)


def _mentions(error: docker.errors.APIError, markers: Sequence[str]) -> bool:
    explanation = str(error.explanation or error).lower()
    return any(marker in explanation for marker in markers)


@contextlib.contextmanager
def _engine_errors(action: str) -> Iterator[None]:
    """Translate engine failures into provider errors while ``action`` runs, by the one
    status table (:func:`engine_answer`).

    Not-found and refused answers pass through: what they mean depends on the caller. A
    transient answer (408, 409, 429, 5xx) is transient, unless it is the container
    runtime's failure (:func:`runtime_failure`); 401 and 403 are the engine refusing
    corral's access. A 409 a caller foresees (a name its own earlier attempt took) is
    caught by that caller first.
    """
    try:
        yield
    except docker.errors.NotFound:
        raise
    except requests.exceptions.Timeout as exc:
        raise ProviderTimeoutError(f"the Docker Engine did not answer while {action}") from exc
    except docker.errors.APIError as exc:
        answer = engine_answer(exc)
        if answer is StatusAnswer.CREDENTIAL_REJECTED:
            raise CredentialRejectedError(
                f"the Docker Engine refused corral's access while {action} "
                f"(HTTP {exc.status_code}): check the docker provider's engine address and "
                "the client certificate or authorization plugin that admits it"
            ) from exc
        if answer is not StatusAnswer.TRANSIENT:
            raise
        if runtime_failure(exc):
            raise PermanentProviderError(
                f"the container runtime failed while {action}: {_short(exc, RUNTIME_MESSAGE_LIMIT)}"
            ) from exc
        raise ProviderUnavailableError(
            f"the Docker Engine failed while {action}: {_short(exc)}"
        ) from exc
    except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
        raise ProviderUnavailableError(
            f"the Docker Engine could not be reached while {action}: {_short(exc)}"
        ) from exc


def _short(error: BaseException, limit: int = 300) -> str:
    text = str(getattr(error, "explanation", None) or error)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class DockerProvider(SandboxProvider):
    """Sandboxes as containers on a Docker Engine."""

    id = "docker"
    display_name = BUILTIN["docker"].display_name
    config_model = DockerProviderConfig
    options_model = DockerProviderOptions
    mounts_api_socket = True
    config: DockerProviderConfig

    def __init__(self, config: DockerProviderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._client: docker.DockerClient | None = None
        self._lock = threading.Lock()

    @property
    def _egress(self) -> HostProxies:
        """The egress proxies of this host's sandboxes with allowed hosts: one host process
        per container (it must connect from the host, and a container without network has
        no other way out), started before the container and stopped by terminate."""
        return HostProxies(
            self.state_dir / "docker-egress",
            self.egress_open_networks,
            self.egress_upstream_ca_file,
        )

    @property
    def client(self) -> docker.DockerClient:
        with self._lock:
            if self._client is None:
                _probe_unix_socket(self.config.base_url)
                with _engine_errors("connecting"):
                    if self.config.base_url:
                        self._client = docker.DockerClient(base_url=self.config.base_url)
                    else:
                        self._client = docker.from_env()
            return self._client

    # -- lifecycle -----------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, DockerProviderOptions)
        if spec.resources.gpu:
            raise InvalidProviderConfigError(
                "this docker provider has no GPU support configured; route GPU work elsewhere"
            )
        name = container_name(spec.sandbox_id)
        existing = self._find(name)
        if existing is not None:
            return self._adopt(spec, existing)
        self._check_capacity()
        image = spec.image or options.image or self.config.image
        egress = self._egress_proxy(spec)
        try:
            container = self._create(spec, options, image, egress)
        except BaseException:
            self._egress.stop(name)  # nothing half-made stays behind
            raise
        if container is None:  # created concurrently under the same name
            return self._adopt(spec, self.client.containers.get(name))
        self._start(container, spec)
        return self._handle(spec, container.name)

    def _egress_proxy(self, spec: SandboxSpec) -> tuple[Path, dict[str, str]] | None:
        """Start corral's egress proxy for a sandbox with allowed hosts or secret bindings:
        its socket's directory on this host and the sandbox's variables for it, or None
        without one."""
        if not spec.egress.proxied:
            return None
        name = container_name(spec.sandbox_id)
        # It never outlives the sandbox's deadline, even if no terminate ever comes.
        timeout_s = spec.resources.timeout_s or self.config.default_timeout_s
        return self._egress.start(name, spec.egress, exit_after_s=timeout_s + 60)

    def _create(
        self,
        spec: SandboxSpec,
        options: DockerProviderOptions,
        image: str,
        egress: tuple[Path, dict[str, str]] | None,
    ) -> Any:
        """The created container; None when one of that name was created concurrently."""
        with _engine_errors(f"creating the container for {spec.sandbox_id}"):
            try:
                args = self._create_args(spec, options, image, egress)
                return self.client.containers.create(**args)
            except docker.errors.ImageNotFound as exc:
                raise SandboxCreateError(
                    f"image {image!r} is not on the Docker Engine and no registry is used; build "
                    "it (`make sandbox-image`), or give the pool an image that is there: "
                    "`corral pools create ... --provider docker --sandbox-config "
                    '\'{"image": "IMAGE"}\'` (or `image` in the provider\'s configuration)'
                ) from exc
            except docker.errors.APIError as exc:
                if exc.status_code == 409:
                    return None
                if engine_trouble(exc):
                    raise  # transient (_engine_errors)
                raise SandboxCreateError(
                    self._refusal("the Docker Engine refused the container", exc)
                ) from exc

    def _create_args(
        self,
        spec: SandboxSpec,
        options: DockerProviderOptions,
        image: str,
        egress_proxy: tuple[Path, dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        timeout_s = spec.resources.timeout_s or self.config.default_timeout_s
        labels = {
            **spec.managed_labels(),
            DEPLOYMENT_LABEL: self.config.deployment,
            DEADLINE_LABEL: str(int(time.time()) + timeout_s),
        }
        args: dict[str, Any] = {
            "image": image,
            "name": container_name(spec.sandbox_id),
            "labels": labels,
            "environment": spec.sandbox_env(),
            "volumes": {},
            "working_dir": WORKDIR,
            "detach": True,
            # No capability, and none regained through a set-uid binary of the chosen image
            # (the runner needs none: it runs as its image's user, which owns /work).
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": self.config.pids_limit,
            "read_only": self.config.read_only_root,
            "tmpfs": {"/tmp": "rw,nosuid,size=256m,mode=1777"},  # noqa: S108 - the container's own /tmp
        }
        args["user"], replaced_root = self._run_as(image)
        if self.config.read_only_root or replaced_root:
            # Writable by the user whatever the image made of its /work (a root image's is
            # root's, or missing).
            args["tmpfs"][WORKDIR] = "rw,exec,size=1g" + _owner_options(args["user"])
        if self.config.max_log_mb is not None:
            args["log_config"] = _bounded_log(self.config.max_log_mb)
        if options.command:
            args["entrypoint"] = list(options.command)
        if self.config.runtime:
            args["runtime"] = self.config.runtime
        if spec.resources.cpu:
            args["nano_cpus"] = int(spec.resources.cpu * 1e9)
        if spec.resources.memory_mb:
            args["mem_limit"] = spec.resources.memory_mb * 1024 * 1024
        self._network_args(args, spec, egress_proxy)
        if self.config.tool_cache_dir:
            args["volumes"][self.config.tool_cache_dir] = {"bind": TOOL_CACHE_MOUNT, "mode": "ro"}
            args["environment"] = {**args["environment"], "CORRAL_TOOL_CACHE": TOOL_CACHE_MOUNT}
        return args

    def _network_args(
        self,
        args: dict[str, Any],
        spec: SandboxSpec,
        egress_proxy: tuple[Path, dict[str, str]] | None,
    ) -> None:
        """The container's network in ``args``: the configured one, or none with the api's
        socket and corral's egress proxy (allowed hosts or bindings) mounted in."""
        if spec.egress.allow_network and egress_proxy is None:
            args["network_mode"] = self.config.network
            return
        args["network_mode"] = "none"
        if spec.control_url.startswith("unix://"):
            socket_path = spec.control_url.removeprefix("unix://")
            # Its directory, read-only (see corral.providers.local.isolation): the runner
            # reaches an api that restarted, and cannot replace the socket.
            folder = os.path.dirname(socket_path)
            args["volumes"][folder] = {"bind": folder, "mode": "ro"}
        if egress_proxy is not None:
            directory, proxy_env = egress_proxy
            args["volumes"][str(directory)] = {"bind": SANDBOX_PROXY_DIR, "mode": "ro"}
            args["environment"] = {**args["environment"], **proxy_env}

    def _run_as(self, image: str) -> tuple[str, bool]:
        """The user the container runs as (the configured one, else the image's unless that
        is root or unset, else ``sandbox_user``), and whether it replaces the image's root."""
        if self.config.user:
            return self.config.user, False
        with _engine_errors(f"inspecting {image}"):
            user = self.client.images.get(image).attrs.get("Config", {}).get("User") or ""
        if is_root_user(user):
            return self.config.sandbox_user, True
        return user, False

    def _start(self, container: Any, spec: SandboxSpec) -> None:
        try:
            with _engine_errors(f"starting {container.name}"):
                try:
                    container.start()
                except docker.errors.APIError as exc:
                    if engine_trouble(exc):
                        raise  # transient (_engine_errors)
                    # Refused, or the runtime failed to start it: the same again would too.
                    raise SandboxVerificationError(
                        self._refusal(f"container for {spec.sandbox_id} did not start", exc)
                    ) from exc
        except (SandboxVerificationError, ProviderUnavailableError):
            self._remove(container.name)
            raise

    def _refusal(self, what: str, error: docker.errors.APIError) -> str:
        """``what``, then the engine's words: whole when they are the runtime's, and with
        what to do when the configured runtime is not registered with the engine."""
        if not runtime_failure(error):
            return f"{what}: {_short(error)}"
        message = f"{what}: {_short(error, RUNTIME_MESSAGE_LIMIT)}"
        if self.config.runtime and _mentions(error, _UNKNOWN_RUNTIME):
            message += (
                f" (the docker provider's runtime is {self.config.runtime!r}: register it with "
                'the engine, in daemon.json "runtimes", or change the runtime)'
            )
        return message

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        container = self._find(handle.external_id)
        if container is None:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="container no longer exists")
        state = container.attrs.get("State", {})
        status = state.get("Status", container.status)
        if status == "created":
            return SandboxStatus(state=SandboxState.PROVISIONING)
        if status == "paused":
            return SandboxStatus(state=SandboxState.READY, reason="paused")
        if status in ("running", "restarting"):
            return self._running_status(container)
        return _final_status(state)

    def _running_status(self, container: Any) -> SandboxStatus:
        deadline = int(container.labels.get(DEADLINE_LABEL, "0") or 0)
        if deadline and time.time() > deadline:
            with _engine_errors(f"stopping {container.name} at its deadline"):
                container.kill()
            return SandboxStatus(
                state=SandboxState.FAILED, reason="deadline exceeded; the container was killed"
            )
        return SandboxStatus(state=SandboxState.RUNNING)

    def terminate(self, handle: SandboxHandle) -> None:
        try:
            self._stop_container(handle)
        finally:
            # Its egress proxy, if any, ends with it (a proxy whose container is gone too).
            self._egress.stop(handle.external_id)

    def _stop_container(self, handle: SandboxHandle) -> None:
        container = self._find(handle.external_id)
        if container is None:
            return
        with _engine_errors(f"stopping {handle.external_id}"):
            try:
                container.stop(timeout=self.config.grace_period_s)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError:
                pass  # already stopping or stopped; removal below settles it
        self._remove(handle.external_id)

    def health_check(self, org_id: str | None = None) -> ProviderHealth:
        runtime = self.config.runtime
        try:
            self.client.ping()
            version = self.client.version().get("Version", "?")
            runtimes = dict(self.client.info().get("Runtimes") or {}) if runtime else {}
        except (
            docker.errors.DockerException,
            requests.exceptions.RequestException,
            ProviderUnavailableError,
        ) as exc:
            return ProviderHealth(
                healthy=False, message=f"Docker Engine unreachable: {_short(exc)}"
            )
        if runtime is None:
            return ProviderHealth(healthy=True, message=f"Docker Engine {version}")
        if runtime not in runtimes:
            return ProviderHealth(
                healthy=False,
                message=f"Docker Engine {version} has no runtime {runtime!r} registered (it "
                f'has {", ".join(sorted(runtimes))}); register it in its daemon.json "runtimes"',
            )
        return ProviderHealth(healthy=True, message=f"Docker Engine {version}, runtime {runtime}")

    # -- optional abilities ---------------------------------------------------------------

    def list_managed(self) -> list[ManagedSandbox]:
        managed = []
        for summary in self._managed_containers(include_ended=True):
            labels = dict(summary.get("Labels") or {})
            sandbox_id = labels.get("corral.sandbox-id", "")
            handle = SandboxHandle(
                provider_id=self.id,
                external_id=summary["Names"][0].lstrip("/"),
                metadata={
                    "org_id": labels.get("corral.org-id", "unknown"),
                    "sandbox_id": sandbox_id,
                },
            )
            created = summary.get("Created")
            managed.append(
                ManagedSandbox(
                    handle=handle,
                    sandbox_id=sandbox_id,
                    labels=labels,
                    started_at=datetime.fromtimestamp(created, UTC) if created else None,
                    state=_LISTED_STATES.get(str(summary.get("State", ""))),
                )
            )
        return managed

    def capacity(self) -> Capacity:
        return Capacity(limit=self.config.max_concurrent, in_use=len(self._managed_containers()))

    def stream_logs(self, handle: SandboxHandle, *, follow: bool = False) -> Iterator[str]:
        container = self._find(handle.external_id)
        if container is None:
            return
        pending = b""
        with _engine_errors(f"reading the logs of {handle.external_id}"):
            for chunk in container.logs(stream=True, follow=follow):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
        if pending:
            yield pending.decode(errors="replace")

    def end_log(self, handle: SandboxHandle, *, max_lines: int, max_bytes: int) -> str | None:
        container = self._find(handle.external_id)
        if container is None:
            return None
        with _engine_errors(f"reading the end of the log of {handle.external_id}"):
            try:
                # The engine sends the last lines only; a stream, so that lines of any length
                # are read a chunk at a time (and no further than log_tail's limit), not
                # followed (a stream follows unless told not to).
                chunks = container.logs(stream=True, follow=False, tail=max_lines)
            except docker.errors.NotFound:
                return None
            try:
                return log_tail(chunks, max_lines=max_lines, max_bytes=max_bytes)
            finally:
                chunks.close()

    def exec_command(
        self,
        handle: SandboxHandle,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int = DEFAULT_EXEC_OUTPUT_MAX_BYTES,
        user: str | None = None,
    ) -> ExecResult:
        container = self._running(handle)
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if timeout_s is not None:
            # The engine has no exec timeout; coreutils' timeout kills the command instead.
            argv = ["timeout", "--signal=KILL", f"{timeout_s:g}", *argv]
        started = time.monotonic()
        with _engine_errors(f"running a command in {handle.external_id}"):
            output, exit_code = exec_bounded(
                self.client.api,
                container.id,
                argv,
                environment=env or {},
                workdir=confine(cwd) if cwd else WORKDIR,
                user=user or "",
                max_output_bytes=max_output_bytes,
            )
        if exit_code is None:
            raise ProviderUnavailableError(
                f"the Docker Engine's stream of a command in {handle.external_id} ended before "
                "the command did"
            )
        if timeout_s is not None and exit_code == KILLED_EXIT:  # timeout --signal=KILL
            raise ProviderTimeoutError(f"the command outlived its {timeout_s:g}s timeout")
        return output.result(exit_code=exit_code, duration_s=time.monotonic() - started)

    def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        destination = confine(target)
        container = self._running(handle)
        directory, name = posixpath.split(destination)
        self.exec_command(handle, ["mkdir", "-p", directory])
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            info = tar.gettarinfo(str(source), arcname=name)
            info.mode = 0o644
            with source.open("rb") as reader:
                tar.addfile(info, reader)
        with _engine_errors(f"copying into {handle.external_id}"):
            container.put_archive(directory, archive.getvalue())

    def download_file(
        self,
        handle: SandboxHandle,
        source: str,
        target: Path,
        *,
        max_bytes: int = DEFAULT_DOWNLOAD_MAX_BYTES,
    ) -> None:
        origin = confine(source)
        container = self._running(handle)
        with _engine_errors(f"copying out of {handle.external_id}"):
            try:
                copy_out(
                    self.client.api,
                    container.id,
                    origin,
                    target,
                    source=source,
                    max_bytes=max_bytes,
                )
            except docker.errors.NotFound as exc:
                raise SandboxPathError(f"{source!r} does not exist in the sandbox") from exc

    # -- internals -----------------------------------------------------------------------

    def _find(self, name: str) -> Any:
        with _engine_errors(f"looking up {name}"):
            try:
                return self.client.containers.get(name)
            except docker.errors.NotFound:
                return None

    def _running(self, handle: SandboxHandle) -> Any:
        container = self._find(handle.external_id)
        if container is None or container.status != "running":
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
        return container

    def _adopt(self, spec: SandboxSpec, container: Any) -> SandboxHandle:
        """A second provision for the same sandbox returns the existing container."""
        if container.labels.get("corral.org-id") != spec.org_id:
            raise SandboxCreateError(
                f"container {container.name} exists but does not belong to this sandbox"
            )
        if container.status == "created":
            self._start(container, spec)
        return self._handle(spec, container.name)

    def _check_capacity(self) -> None:
        limit = self.config.max_concurrent
        if limit is not None and self.capacity().in_use >= limit:
            raise CapacityExhaustedError(f"docker provider is at its limit of {limit} containers")

    def _managed_containers(self, *, include_ended: bool = False) -> list[dict[str, Any]]:
        """This deployment's containers, as the engine's list summaries: the live ones, and
        with ``include_ended`` also those that exited and were not removed yet.

        The summaries come from one list call: no per-container inspect, which could race
        with a container being removed meanwhile.
        """
        statuses = ["created", "running", "paused", "restarting"]
        if include_ended:
            statuses += ["exited", "dead"]
        filters = {
            "label": ["corral.managed=true", f"{DEPLOYMENT_LABEL}={self.config.deployment}"],
            "status": statuses,
        }
        with _engine_errors("listing containers"):
            return list(self.client.api.containers(all=True, filters=filters))

    def _remove(self, name: str) -> None:
        with _engine_errors(f"removing {name}"):
            try:
                # v: the anonymous volumes of the image's VOLUMEs go with it, not left on the
                # engine's disk.
                self.client.containers.get(name).remove(force=True, v=True)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: removal already in progress
                    raise


def _probe_unix_socket(base_url: str | None) -> None:
    """Fail fast, and without the SDK, when a Unix-socket engine is not there.

    (The SDK leaves its socket open when the first connection fails.)
    """
    if not base_url or not base_url.startswith("unix://"):
        return
    path = base_url.removeprefix("unix://")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            probe.connect(path)
    except OSError as exc:
        raise ProviderUnavailableError(
            f"the Docker Engine at {base_url} could not be reached: {exc.strerror or exc}"
        ) from exc


def container_name(sandbox_id: str) -> str:
    return f"corral-{sandbox_id}"


def confine(path: str) -> str:
    """``path`` inside the sandbox's work directory, or SandboxPathError."""
    joined = posixpath.normpath(posixpath.join(WORKDIR, path))
    if joined != WORKDIR and not joined.startswith(WORKDIR + "/"):
        raise SandboxPathError(
            f"path {path!r} is outside the sandbox work directory; use a path relative to it"
        )
    return joined


def _final_status(state: Mapping[str, Any]) -> SandboxStatus:
    return exit_status(
        state.get("ExitCode"),
        out_of_memory=bool(state.get("OOMKilled")),
        detail=state.get("Error") or None,
    )
