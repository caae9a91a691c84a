"""The kubernetes provider: one ``batch/v1`` Job per sandbox, through the official client.

A sandbox is three objects in the configured namespace (:mod:`corral.providers.kubernetes.objects`):
the Job, created suspended; a Secret holding the registration token, owned by the Job and
referenced from the container's env (the token is in no other object, log or message); and,
for a sandbox without network, a NetworkPolicy owned by the Job that lets the pod reach DNS
and the corral api only. Then the Job is resumed, so the pod never runs without its policy.
A crash in between leaves a suspended Job that the next provision (the worker retries)
completes; nothing is ever left that its Job does not own. A retry brings a token of its own
(corral revoked the last one), so a Secret holding another token is replaced before the Job
starts, and a Job that started with one is deleted for the next retry to make afresh.

Every call corral makes is idempotent: reads; creates by name, whose repeat answers 409 (the
object is then read and adopted when it is this sandbox's); deletes, whose repeat answers 404;
and the one patch, which sets a value. So a call the API answers 429 or 5xx, or does not
answer, is sent again at once, ``api_retries`` times with a short jittered back-off (a 429's
``Retry-After`` honoured up to ``api_retry_max_s``): a brown-out of the API costs a provision
some time, rarely the provision (:meth:`KubernetesProvider._call`).

Deleting the Job (foreground) deletes its pod, Secret and policy. Statuses come from the Job's
conditions and its pod (phase, exit code, and start trouble measured on the API server's
clock). Logs and exec go through the pod API; the inventory is a label query limited to this
deployment.

Each provider instance builds its own ``ApiClient`` from a kubeconfig path and context, or from
the pod's service account (in-cluster): the client's global configuration is never touched,
so several providers may talk to several clusters in one process.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import urllib3.exceptions
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.config import incluster_config, kube_config
from kubernetes.config.config_exception import ConfigException
from kubernetes.stream import stream

from corral.providers.base import (
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
)
from corral.providers.descriptors import BUILTIN
from corral.providers.errors import (
    CapacityExhaustedError,
    CredentialRejectedError,
    InvalidProviderConfigError,
    PermanentProviderError,
    ProviderError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
)
from corral.providers.kubernetes import objects
from corral.providers.kubernetes.execution import read_exec
from corral.providers.kubernetes.objects import (
    JSON,
    KubernetesProviderConfig,
    KubernetesProviderOptions,
)
from corral.providers.size_limits import END_LOG_READ_LIMIT, ExecOutput, log_tail
from corral.providers.vendor import StatusAnswer, status_answer

__all__ = ["KubernetesProvider", "KubernetesProviderConfig", "KubernetesProviderOptions"]

_PAGE = 500
_FOLLOW_IDLE_S = 3600  # a followed log ends after this long without output
_KILLED = (124, 137)  # timeout(1): TERM and KILL
_RBAC = "jobs, pods, pods/log, pods/exec, secrets, networkpolicies, events, resourcequotas"


class KubernetesProvider(SandboxProvider):
    """Sandboxes as Jobs in a Kubernetes namespace."""

    id = "kubernetes"
    display_name = BUILTIN["kubernetes"].display_name
    config_model = KubernetesProviderConfig
    options_model = KubernetesProviderOptions
    config: KubernetesProviderConfig

    def __init__(self, config: KubernetesProviderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._api: Any = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the API client's connections (a later call opens new ones)."""
        with self._lock:
            api, self._api = self._api, None
        if api is not None:
            api.close()

    # -- the API client --------------------------------------------------------------------

    @property
    def api(self) -> Any:
        """This provider's own ``ApiClient``, built on first use."""
        with self._lock:
            if self._api is None:
                self._api = self._connect()
            return self._api

    def _connect(self) -> Any:
        try:
            if not self.config.in_cluster:
                # The config loaders are untyped; what they return is an ApiClient.
                return kube_config.new_client_from_config(  # type: ignore[no-untyped-call]
                    config_file=self._kubeconfig_path(),
                    context=self.config.context,
                    persist_config=False,  # never write refreshed tokens into the file
                )
            configuration = client.Configuration()
            # The loader re-reads the token file as it rotates (bound service account tokens).
            loader = incluster_config.InClusterConfigLoader(  # type: ignore[no-untyped-call]
                token_filename=self._service_account_file("token"),
                cert_filename=self._service_account_file("ca.crt"),
                environ=os.environ,
            )
            loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
            return client.ApiClient(configuration)
        except (ConfigException, OSError) as exc:
            raise InvalidProviderConfigError(
                f"cannot load the Kubernetes client configuration from {self._identity()}: {exc}"
            ) from exc

    def _kubeconfig_path(self) -> str:
        path = self.config.kubeconfig or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
        return os.path.expanduser(path)

    def _service_account_file(self, name: str) -> str:
        default = os.path.dirname(incluster_config.SERVICE_TOKEN_FILENAME)
        return os.path.join(self.config.service_account_dir or default, name)

    def _identity(self) -> str:
        """Which credentials the provider uses, named so that an operator can fix them."""
        if self.config.in_cluster:
            return f"the in-cluster service account (token {self._service_account_file('token')})"
        context = self.config.context or "(the current context)"
        return f"context {context} of kubeconfig {self._kubeconfig_path()}"

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Call one API method with this provider's request timeout, sending it again on a
        transient answer (429, 5xx, none), up to ``api_retries`` times: every call corral
        makes is idempotent (see the module's docstring). What is left is the caller's to
        translate (:meth:`_api_errors`)."""
        kwargs.setdefault("_request_timeout", self.config.request_timeout_s)
        retries = self.config.api_retries
        for attempt in range(retries + 1):
            try:
                return method(*args, **kwargs)
            except ApiException as exc:
                status = int(exc.status or 0)
                if attempt == retries or not _sent_again(status):
                    raise
                wait = _retry_after(exc)
            except urllib3.exceptions.HTTPError as exc:
                if attempt == retries or _timed_out(exc):
                    raise  # a slow API: waiting longer is the provision's retry's to decide
                wait = None
            time.sleep(self._backoff_s(attempt, wait))
        raise AssertionError("not reached: the last attempt returns or raises")

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        """Full jitter, doubling from 50 ms; a ``Retry-After`` is waited out; both capped."""
        cap = self.config.api_retry_max_s
        if retry_after is not None:
            return min(cap, retry_after)
        return random.uniform(0, min(cap, 0.05 * 2**attempt))  # noqa: S311 - jitter, not crypto

    def _json(self, obj: Any) -> JSON:
        data = self.api.sanitize_for_serialization(obj)
        if not isinstance(data, dict):
            raise ProviderUnavailableError(f"the Kubernetes API answered {type(obj).__name__}")
        return data

    def _apis(self, kind: str) -> Any:
        """The API group object serving ``kind``: ``batch``, ``core`` or ``networking``."""
        groups = {
            "batch": client.BatchV1Api,
            "core": client.CoreV1Api,
            "networking": client.NetworkingV1Api,
        }
        return groups[kind](self.api)

    @contextlib.contextmanager
    def _api_errors(
        self, action: str, *, creating: bool = False, secret: str | None = None
    ) -> Iterator[None]:
        """Translate the client's failures into provider errors while ``action`` runs.

        Answers a caller expects (404, 409) are caught inside the block; the rest are
        classified here by status. ``secret`` is scrubbed from every message.
        """
        try:
            yield
        except ApiException as exc:
            message = objects.api_message(exc.body, exc.reason, secret)
            raise self._api_error(int(exc.status or 0), message, action, creating=creating) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise self._transport_error(exc, action) from exc

    def _api_error(
        self, status: int, message: str, action: str, *, creating: bool
    ) -> ProviderError:
        """The provider error for an API answer with ``status`` and its Status ``message``."""
        namespace = self.config.namespace
        # The vendors' status table decides; the messages and the refinements are Kubernetes'.
        answer = status_answer(status) if status else StatusAnswer.TRANSIENT  # 0: no answer
        if status == 403 and "exceeded quota" in message:
            # A namespace's ResourceQuota answers 403 too: not the credential's fault, and it
            # passes as sandboxes end.
            return CapacityExhaustedError(f"namespace {namespace} is at its quota: {message}")
        if answer is StatusAnswer.CREDENTIAL_REJECTED:
            return CredentialRejectedError(self._rejected(status, action, message))
        if answer is StatusAnswer.TRANSIENT:
            return ProviderUnavailableError(
                f"the Kubernetes API failed while {action} ({status or 'no answer'}): {message}"
            )
        if creating and status == 404 and "namespaces" in message:
            return SandboxCreateError(
                f"namespace {namespace} does not exist on the cluster of {self._identity()}: "
                "create it, or set the provider's namespace"
            )
        kind = SandboxCreateError if creating else PermanentProviderError
        if answer is StatusAnswer.NOT_FOUND and not creating:
            kind = SandboxNotRunningError
        return kind(f"the Kubernetes API refused {action} ({status}): {message}")

    def _rejected(self, status: int, action: str, message: str) -> str:
        """What to fix when the API rejected the identity: its credentials (401), its RBAC
        rights (403)."""
        if status == 401:
            return (
                f"the Kubernetes API rejected the credentials of {self._identity()} (401) "
                f"while {action}: renew them, or configure other ones"
            )
        return (
            f"the Kubernetes API refused {action} to {self._identity()} ({status}): {message}. "
            f"Grant that identity RBAC rights on {_RBAC} in namespace {self.config.namespace}, "
            "or configure another one"
        )

    def _transport_error(self, exc: urllib3.exceptions.HTTPError, action: str) -> ProviderError:
        reason: Any = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
        where = f"the Kubernetes API at {self.api.configuration.host}"
        if _timed_out(exc):
            return ProviderTimeoutError(
                f"{where} did not answer within {self.config.request_timeout_s:g}s while {action}"
            )
        return ProviderUnavailableError(f"{where} could not be reached while {action}: {reason}")

    # -- lifecycle -------------------------------------------------------------------------

    @staticmethod
    def _allowed_host_rules(spec: SandboxSpec) -> list[objects.JSON]:
        """The policy's rules for the spec's allowed hosts (none without network).

        Raises:
            SandboxCreateError: an allowed host name does not resolve.
        """
        if not spec.egress.restricted:
            return []
        try:
            return objects.allowed_host_rules(spec.egress.allowed_hosts)
        except OSError as exc:
            raise SandboxCreateError(
                "an allowed host does not resolve, so the sandbox's NetworkPolicy cannot name "
                f"its addresses ({exc}); check egress.allowed_hosts"
            ) from exc

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, KubernetesProviderOptions)
        if (not spec.egress.allow_network or spec.egress.restricted) and not (
            spec.control_url.startswith(("http://", "https://"))
        ):
            raise InvalidProviderConfigError(
                "a Kubernetes sandbox without network reaches the api over the cluster network: "
                f"it needs an http(s) control URL, not {spec.control_url.split(':', 1)[0]}://"
            )
        name = objects.job_name(spec.sandbox_id)
        job = self._read_job(name)
        fresh = job is None
        if job is None:
            self._check_capacity()
            job, fresh = self._create_job(objects.job_manifest(self.config, spec, options), spec)
        self._check_owner(job, spec)
        if job["metadata"].get("deletionTimestamp"):
            raise ProviderUnavailableError(f"Job {name} is still being deleted; retry later")
        try:
            self._complete(job, spec, fresh=fresh)
        except PermanentProviderError:
            if fresh:  # nothing half-made stays behind (a suspended Job has no deadline)
                with contextlib.suppress(ProviderError):
                    self.terminate(self._handle(spec, name))
            raise
        return self._handle(spec, name)

    def _create_job(self, manifest: JSON, spec: SandboxSpec) -> tuple[JSON, bool]:
        """The new Job and True, or (created concurrently) the existing one and False."""
        name, secret = manifest["metadata"]["name"], spec.registration_token.get_secret_value()
        with self._api_errors(f"creating Job {name}", creating=True, secret=secret):
            try:
                created = self._call(
                    self._apis("batch").create_namespaced_job, self.config.namespace, manifest
                )
            except ApiException as exc:
                found = self._read_job(name) if exc.status == 409 else None
                if found is None:
                    raise
                return found, False  # made by another delivery of this provision: adopt it
        return self._json(created), True

    def _check_owner(self, job: JSON, spec: SandboxSpec) -> None:
        """A Job found under this sandbox's name must be this sandbox's."""
        labels = job["metadata"].get("labels") or {}
        mine = {
            objects.SANDBOX_LABEL: spec.sandbox_id,
            "corral.org-id": spec.org_id,
            objects.DEPLOYMENT_LABEL: self.config.deployment,
        }
        if any(labels.get(key) != value for key, value in mine.items()):
            raise SandboxCreateError(
                f"Job {job['metadata']['name']} exists in namespace {self.config.namespace} "
                "but does not belong to this sandbox and deployment"
            )

    def _complete(self, job: JSON, spec: SandboxSpec, *, fresh: bool) -> None:
        """Make what the Job needs, owned by it, then let it run. Safe to repeat: a second
        provision with the same spec finds everything in place and changes nothing.

        A retry comes with a token of its own (corral revoked the earlier attempt's), so a
        Secret holding another token is never kept: while the Job is suspended it is replaced;
        once the Job has started, its pod may have read the revoked token already, so the Job
        is deleted and the retry after it makes a new one.
        """
        token = spec.registration_token.get_secret_value()
        labels = objects.sandbox_labels(self.config, spec)
        secret = objects.secret_manifest(job, labels, token)
        suspended = objects.is_suspended(job)
        kept = self._ensure_owned(
            "secret", job, secret, fresh=fresh, token=token, replace=suspended
        )
        if not kept:
            self._discard_started(job, spec)
        if not spec.egress.allow_network or spec.egress.restricted:
            allowed = self._allowed_host_rules(spec)
            policy = objects.network_policy_manifest(self.config, spec, job, allowed)
            self._ensure_owned("network_policy", job, policy, fresh=fresh)
        if suspended:
            name = job["metadata"]["name"]
            with self._api_errors(f"starting Job {name}", creating=True):
                self._call(
                    self._apis("batch").patch_namespaced_job,
                    name,
                    self.config.namespace,
                    {"spec": {"suspend": False}},
                )

    def _discard_started(self, job: JSON, spec: SandboxSpec) -> None:
        """Delete a started Job whose Secret is not this provision's; always raises.

        Raises:
            ProviderUnavailableError: the Job is being deleted; a retry makes it afresh.
        """
        name = job["metadata"]["name"]
        self.terminate(self._handle(spec, name))
        raise ProviderUnavailableError(
            f"Job {name} was started with an earlier attempt's registration token: deleted it, "
            "so that a retry makes it afresh"
        )

    def _ensure_owned(
        self,
        kind: str,
        job: JSON,
        manifest: JSON,
        *,
        fresh: bool,
        token: str | None = None,
        replace: bool = True,
    ) -> bool:
        """Make sure the Job owns an object like ``manifest`` (``kind``: ``secret`` or
        ``network_policy``); False, with nothing changed, when one that does not fit is there
        and ``replace`` is False.

        For a Job made just now (``fresh``) it is created straight away. Otherwise what is
        there is read first, so that a repeated provision sends nothing (the token least of
        all). One that does not fit is replaced: one the Job does not own (left by an earlier
        Job of that name, about to be collected), or a Secret holding another ``token`` than
        this provision's (an earlier attempt's, revoked since).
        """
        api = self._apis("core" if kind == "secret" else "networking")
        name, namespace = manifest["metadata"]["name"], self.config.namespace
        with self._api_errors(f"creating {manifest['kind']} {name}", creating=True, secret=token):
            for attempt in range(2):
                if attempt or not fresh:
                    current = self._read_optional(getattr(api, f"read_namespaced_{kind}"), name)
                    if current is not None and _fits(current, job, token):
                        return True
                    if current is not None and not replace:
                        return False
                    if current is not None:
                        self._delete(getattr(api, f"delete_namespaced_{kind}"), name)
                try:
                    self._call(getattr(api, f"create_namespaced_{kind}"), namespace, manifest)
                    return True
                except ApiException as exc:
                    if exc.status != 409 or attempt:
                        raise  # 409: made concurrently; the next round checks whose it is
        raise AssertionError("not reached: the second round returns or raises")

    def _read_optional(self, method: Any, name: str) -> JSON | None:
        """One object of the namespace, or None when it is not there."""
        try:
            return self._json(self._call(method, name, self.config.namespace))
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        job = self._read_job(handle.external_id)
        if job is None:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox no longer exists")
        pods, now = self._job_pods(handle.external_id)
        pod = objects.newest_pod(pods)
        decided = objects.finished_status(job, pod)
        if decided is not None:
            return decided
        if job["metadata"].get("deletionTimestamp"):
            return SandboxStatus(state=SandboxState.TERMINATED, reason="terminated")
        if pod is None or objects.is_suspended(job):
            return SandboxStatus(state=SandboxState.PROVISIONING)
        waiting = objects.stuck_waiting(pod)
        if waiting is None:
            return objects.pod_status(pod)
        # Measured on the API server's clock (``now``): a skewed worker cannot cut it short.
        name = pod["metadata"]["name"]
        field = f"involvedObject.name={name},involvedObject.kind=Pod"
        with self._api_errors(f"reading the events of pod {name}"):
            listed = self._call(
                self._apis("core").list_namespaced_event,
                self.config.namespace,
                field_selector=field,
            )
        events = self._json(listed)
        grace = self.config.image_pull_grace_s
        return objects.stuck_status(waiting, pod, events.get("items") or [], now, grace)

    def terminate(self, handle: SandboxHandle) -> None:
        name = handle.external_id
        with self._api_errors(f"deleting Job {name}"):
            # Foreground: the pod, Secret and policy go first, then the Job.
            self._delete(self._apis("batch").delete_namespaced_job, name, policy="Foreground")

    def _delete(self, method: Any, name: str, *, policy: str = "Background") -> None:
        """Delete one object; one that is not there counts as deleted."""
        try:
            self._call(method, name, self.config.namespace, propagation_policy=policy)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def health_check(self, org_id: str | None = None) -> ProviderHealth:
        try:
            with self._api_errors(f"listing Jobs in namespace {self.config.namespace}"):
                self._call(self._apis("batch").list_namespaced_job, self.config.namespace, limit=1)
        except ProviderError as exc:
            return ProviderHealth(healthy=False, message=exc.message)
        return ProviderHealth(
            healthy=True,
            message=f"the Kubernetes API at {self.api.configuration.host} answers; sandboxes "
            f"go to namespace {self.config.namespace}",
        )

    # -- optional abilities ----------------------------------------------------------------

    def list_managed(self) -> list[ManagedSandbox]:
        managed = []
        for job in self._managed_jobs():
            meta = job["metadata"]
            if meta.get("deletionTimestamp"):
                continue  # on its way out: nothing left to manage
            labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
            sandbox_id = labels.get(objects.SANDBOX_LABEL, "")
            handle = SandboxHandle(
                provider_id=self.id,
                external_id=meta["name"],
                metadata={
                    "org_id": labels.get("corral.org-id", "unknown"),
                    "sandbox_id": sandbox_id,
                },
            )
            started = (job.get("status") or {}).get("startTime") or meta.get("creationTimestamp")
            managed.append(
                ManagedSandbox(
                    handle=handle,
                    sandbox_id=sandbox_id,
                    labels=labels,
                    started_at=objects.parse_time(started),
                    state=objects.listed_state(job),
                )
            )
        return managed

    def capacity(self) -> Capacity:
        """The tighter of the configured ResourceQuota and ``max_concurrent``; with neither,
        no limit and the live managed Jobs in use."""
        candidates = []
        if self.config.quota_name:
            quota = self._quota_capacity(self.config.quota_name)
            if quota is not None:
                candidates.append(quota)
        if self.config.max_concurrent is not None or not candidates:
            live = [job for job in self._managed_jobs() if objects.is_live(job)]
            candidates.append(Capacity(limit=self.config.max_concurrent, in_use=len(live)))
        return min(candidates, key=lambda c: math.inf if c.available is None else c.available)

    def stream_logs(self, handle: SandboxHandle, *, follow: bool = False) -> Iterator[str]:
        # Following has no end in sight: only the wait for the next output is bounded.
        timeout = (self.config.request_timeout_s, _FOLLOW_IDLE_S) if follow else None
        with self._pod_log(handle, follow=follow, timeout=timeout) as chunks:
            if chunks is not None:
                yield from objects.lines(chunks)

    def end_log(self, handle: SandboxHandle, *, max_lines: int, max_bytes: int) -> str | None:
        """The end of the log of the Job's newest pod: the API server sends its last
        ``max_lines`` lines, at most ``END_LOG_READ_LIMIT`` bytes of them."""
        with self._pod_log(
            handle,
            follow=False,
            timeout=self.config.request_timeout_s,
            tail_lines=max_lines,
            limit_bytes=END_LOG_READ_LIMIT,
        ) as chunks:
            if chunks is None:
                return None
            return log_tail(chunks, max_lines=max_lines, max_bytes=max_bytes)

    @contextlib.contextmanager
    def _pod_log(
        self, handle: SandboxHandle, *, follow: bool, timeout: Any, **query: int
    ) -> Iterator[Iterator[bytes] | None]:
        """The log of the Job's newest pod as it streams in, read while the block runs;
        None when there is no pod, or its container has not started or is gone."""
        pod = objects.newest_pod(self._job_pods(handle.external_id)[0])
        if pod is None:
            yield None
            return
        name = pod["metadata"]["name"]
        with self._api_errors(f"reading the log of pod {name}"):
            try:
                response = self._call(
                    self._apis("core").read_namespaced_pod_log,
                    name,
                    self.config.namespace,
                    container=objects.CONTAINER,
                    follow=follow,
                    _preload_content=False,
                    **({"_request_timeout": timeout} if timeout else {}),
                    **query,
                )
            except ApiException as exc:
                if exc.status in (400, 404):  # not started yet, or gone
                    yield None
                    return
                raise
            try:
                yield response.stream(4096)
            finally:
                response.close()
                response.release_conn()

    def exec_command(
        self,
        handle: SandboxHandle,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int = DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ) -> ExecResult:
        argv = objects.exec_argv(command, env=env, cwd=cwd, timeout_s=timeout_s)
        pod = self._running_pod(handle)
        started = time.monotonic()
        output = ExecOutput(max_output_bytes)
        ws = self._open_exec(pod, argv)
        try:
            # timeout(1) kills the command in the pod; past a grace the stream is given up.
            grace = self.config.exec_timeout_grace_s
            deadline = None if timeout_s is None else started + timeout_s + grace
            raw_status = read_exec(ws, output, deadline)
        finally:
            _close_stream(ws)
        if raw_status is None:
            raise ProviderTimeoutError(
                f"the command in {handle.external_id} outlived its {timeout_s:g}s timeout"
            )
        elapsed = time.monotonic() - started
        exit_code, reason = objects.exec_exit(raw_status, "")
        output.stderr.add(reason)  # a command that did not start: why, as a shell says it
        if timeout_s is not None and exit_code in _KILLED and elapsed >= timeout_s:
            raise ProviderTimeoutError(
                f"the command in {handle.external_id} outlived its {timeout_s:g}s timeout and "
                "was killed"
            )
        return output.result(exit_code=exit_code, duration_s=elapsed)

    def _open_exec(self, pod: str, argv: list[str]) -> Any:
        """Open the exec WebSocket. On a client of its own: ``stream()`` swaps the client's
        ``call_api`` while it connects, which other threads sharing it must not see."""
        with client.ApiClient(self.api.configuration) as exec_api:
            try:
                return stream(
                    client.CoreV1Api(exec_api).connect_get_namespaced_pod_exec,
                    pod,
                    self.config.namespace,
                    command=argv,
                    container=objects.CONTAINER,
                    stderr=True,
                    stdin=False,
                    stdout=True,
                    tty=False,
                    _preload_content=False,
                )
            except ApiException as exc:
                raise self._exec_refused(exc, pod) from exc

    def _exec_refused(self, exc: ApiException, pod: str) -> ProviderError:
        """The API server refuses an exec before the WebSocket upgrade; the client reports
        that as status 0, with the handshake's status and body in its reason."""
        text = str(exc.reason or "")
        found = re.search(r"Handshake status (\d{3})", text)
        status = int(found.group(1)) if found else 0
        messages = re.findall(r'"message":\s*"((?:[^"\\]|\\.)*)"', text)
        detail = messages[-1] if messages else text[:300]
        if status in (400, 404):
            return SandboxNotRunningError(f"pod {pod} cannot run commands now: {detail}")
        return self._api_error(status, detail, f"running a command in pod {pod}", creating=False)

    # -- internals -------------------------------------------------------------------------

    def _read_job(self, name: str) -> JSON | None:
        with self._api_errors(f"reading Job {name}"):
            try:
                job = self._call(
                    self._apis("batch").read_namespaced_job, name, self.config.namespace
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        return self._json(job)

    def _job_pods(self, job: str) -> tuple[list[JSON], datetime]:
        """The Job's pods, and the API server's time of the answer (its Date header)."""
        with self._api_errors(f"listing the pods of Job {job}"):
            listed, _, headers = self._call(
                self._apis("core").list_namespaced_pod_with_http_info,
                self.config.namespace,
                label_selector=f"{objects.JOB_NAME_LABEL}={job}",
            )
        return list(self._json(listed).get("items") or []), objects.server_time(headers)

    def _running_pod(self, handle: SandboxHandle) -> str:
        pods = self._job_pods(handle.external_id)[0]
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        pod = objects.newest_pod(running)
        if pod is None:
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
        return str(pod["metadata"]["name"])

    def _managed_jobs(self) -> list[JSON]:
        selector = f"corral.managed=true,{objects.DEPLOYMENT_LABEL}={self.config.deployment}"
        jobs: list[JSON] = []
        token: str | None = None
        with self._api_errors(f"listing Jobs in namespace {self.config.namespace}"):
            while True:
                page = self._json(
                    self._call(
                        self._apis("batch").list_namespaced_job,
                        self.config.namespace,
                        label_selector=selector,
                        limit=_PAGE,
                        _continue=token,
                    )
                )
                jobs += page.get("items") or []
                token = (page.get("metadata") or {}).get("continue")
                if not token:
                    return jobs

    def _quota_capacity(self, name: str) -> Capacity | None:
        with self._api_errors(f"reading ResourceQuota {name}"):
            try:
                quota = self._call(
                    self._apis("core").read_namespaced_resource_quota, name, self.config.namespace
                )
            except ApiException as exc:
                if exc.status == 404:
                    raise InvalidProviderConfigError(
                        f"ResourceQuota {name} (quota_name) does not exist in namespace "
                        f"{self.config.namespace}"
                    ) from exc
                raise
        status = self._json(quota).get("status") or {}
        for key in ("count/jobs.batch", "pods"):
            hard = (status.get("hard") or {}).get(key)
            if hard is not None:
                used = (status.get("used") or {}).get(key, "0")
                return Capacity(limit=objects.object_count(hard), in_use=objects.object_count(used))
        return None

    def _check_capacity(self) -> None:
        if self.config.quota_name is None and self.config.max_concurrent is None:
            return
        if self.capacity().available == 0:
            raise CapacityExhaustedError(
                f"namespace {self.config.namespace} has no room for another sandbox Job"
            )


def _sent_again(status: int) -> bool:
    """Whether a call answered ``status`` is sent again: the vendors' table says transient,
    and it is not 409, which the callers of creates expect (made already: adopt or replace)."""
    return status != 409 and (status == 0 or status_answer(status) is StatusAnswer.TRANSIENT)


def _timed_out(exc: urllib3.exceptions.HTTPError) -> bool:
    """Whether the API took longer than the request timeout to answer (or to connect)."""
    reason: Any = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
    timeouts = (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ConnectTimeoutError)
    # urllib3 makes a refused connection a ConnectTimeoutError too: it is not a timeout.
    return isinstance(reason, timeouts) and not isinstance(
        reason, urllib3.exceptions.NewConnectionError
    )


def _retry_after(exc: ApiException) -> float | None:
    """The seconds a 429 or 503 asks to wait (``Retry-After``), when it says."""
    value = (exc.headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the back-off decides


def _fits(current: JSON, job: JSON, token: str | None) -> bool:
    """An object the Job owns, and for the token's Secret, one that holds ``token``."""
    return objects.is_owned_by(current, job) and (
        token is None or objects.holds_token(current, token)
    )


def _close_stream(ws: Any) -> None:
    """Close the exec WebSocket and its socket: ``WSClient.close()`` does nothing once the
    server has closed the stream (as every finished exec does), which would leave the socket
    to the garbage collector."""
    ws.close()
    sock = getattr(ws, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown()
