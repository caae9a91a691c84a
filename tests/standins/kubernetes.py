"""A protocol-level stand-in for the Kubernetes API server, for testing corral's kubernetes
provider through the official ``kubernetes`` client on loopback, where no cluster is reachable.

It serves Jobs, Pods (read, log, exec over WebSocket), Secrets, NetworkPolicies, Events and
ResourceQuotas in the API server's URL layout and JSON shapes, with its ``Status`` error bodies;
it plays the job controller (suspend and resume included) and kubelet so a Job gets a pod that a
test moves through its phases; it collects garbage by ``ownerReferences``; it refuses creates
beyond a ``count/jobs.batch`` quota; and a test can make it fail, hang, or refuse a token.

Typical use::

    with KubernetesStandin(token="t") as k8s:
        path = k8s.write_kubeconfig(tmp_path, context="standin")
        ...  # the provider creates Job "w1"
        k8s.succeed_job("w1", log="done\\n")
        k8s.fail_next(429, count=2, path_prefix="/apis/batch/v1/")

The server runs in a daemon thread (uvicorn, h11 and wsproto) and ``stop()`` leaves no thread
or port behind."""

from __future__ import annotations

import base64
import copy
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import uvicorn
import yaml
from kubernetes.client import ApiClient, Configuration

from tests.standins.kubernetes_api import JSON
from tests.standins.kubernetes_app import StandinApp
from tests.standins.kubernetes_exec import ExecHandler, ExecResult, default_exec
from tests.standins.kubernetes_gate import FailureRule, Gate, RecordedRequest
from tests.standins.kubernetes_jobs import FAILED_MESSAGES
from tests.standins.kubernetes_store import Store
from tests.standins.kubernetes_tls import TlsFiles, write_tls_files

DEFAULT_TOKEN = "standin-token"
DEFAULT_USER = "system:serviceaccount:corral:provider"
__all__ = [
    "DEFAULT_TOKEN",
    "ExecHandler",
    "ExecResult",
    "KubernetesStandin",
    "RecordedRequest",
    "default_exec",
]


class KubernetesStandin:
    """The stand-in API server. Constructor arguments:

    - ``token``: the bearer token accepted with full access; any other gets 401.
    - ``namespace``: the namespace helpers default to (created, with ``namespaces``).
    - ``version``: the ``major.minor`` served at ``/version``; from 1.31 finished Jobs also carry
      ``SuccessCriteriaMet`` / ``FailureTarget`` before ``Complete`` / ``Failed``.
    - ``pod_start_delay``: seconds a new pod stays Pending before it runs; None: until a test
      calls ``run_job``.
    - ``gc_delay``: seconds a Foreground/Orphan deletion stays visible (deletionTimestamp set).
    - ``tls``: serve HTTPS with a fresh CA (``ca_cert_path``), as in-cluster config needs.
    - ``run_commands``: when a pod starts by itself (``pod_start_delay``) or by ``run_job``, play
      its container's ``command``/``args`` (``container_program``): ``echo`` goes to the log,
      ``exit N`` ends the pod with N, ``sleep`` keeps it running. For suites (the provider
      contract) that start sandboxes with a command and cannot drive each pod by hand.
    """

    def __init__(
        self,
        token: str = DEFAULT_TOKEN,
        *,
        namespace: str = "default",
        namespaces: Iterable[str] = (),
        version: str = "1.31",
        pod_start_delay: float | None = 0.0,
        gc_delay: float = 0.0,
        tls: bool = False,
        user: str = DEFAULT_USER,
        run_commands: bool = False,
    ) -> None:
        self.token = token
        self.namespace = namespace
        major, minor = (int(part) for part in version.split(".")[:2])
        self.store = Store([namespace, *namespaces], gc_delay=gc_delay)
        self.store.jobs.pod_start_delay = pod_start_delay
        self.store.jobs.terminal_precursors = (major, minor) >= (1, 31)
        self.store.jobs.run_commands = run_commands
        self.gate = Gate()
        self.gate.add_token(token, user)
        self._app = StandinApp(self.store, self.gate, (major, minor))
        self._tls = tls
        self._tls_dir: Path | None = None
        self._tls_files: TlsFiles | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        """Bind a free loopback port and serve from a daemon thread; returns once listening."""
        if self._thread is not None:
            raise RuntimeError("the stand-in is already running")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self._socket, self.port = sock, sock.getsockname()[1]
        tls_options: dict[str, Any] = {}
        if self._tls:
            self._tls_dir = Path(tempfile.mkdtemp(prefix="k8s-standin-"))
            self._tls_files = write_tls_files(self._tls_dir)
            tls_options = {
                "ssl_certfile": str(self._tls_files.cert),
                "ssl_keyfile": str(self._tls_files.key),
            }
        config = uvicorn.Config(
            self._app,
            http="h11",
            ws="wsproto",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            date_header=False,
            **tls_options,  # the app dates answers by its own clock
        )
        self._server = uvicorn.Server(config)
        self.gate.stopping.clear()
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="kubernetes-standin",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Kubernetes stand-in did not start")
            time.sleep(0.002)
        return self

    def stop(self) -> None:
        """Stop serving, wait for the thread, release the port and the TLS files."""
        self.gate.stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._socket is not None:
            self._socket.close()
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
        self._server = self._thread = self._socket = self._tls_dir = self._tls_files = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- how clients reach it -----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_cert_path(self) -> Path | None:
        """The CA that signed the serving certificate when ``tls=True``."""
        return self._tls_files.ca_cert if self._tls_files else None

    def configuration(self, token: str | None = None) -> Configuration:
        """A client ``Configuration`` for this server (with ``token`` instead of the good one)."""
        config = Configuration(
            host=self.url,
            api_key={"BearerToken": self.token if token is None else token},
            api_key_prefix={"BearerToken": "Bearer"},
        )
        if self.ca_cert_path is not None:
            config.ssl_ca_cert = str(self.ca_cert_path)
        return config

    def api_client(self, token: str | None = None) -> ApiClient:
        """An ``ApiClient`` on ``configuration()``; close it (or use it as a context manager)."""
        return ApiClient(self.configuration(token))

    def write_kubeconfig(
        self,
        directory: Path,
        *,
        context: str = "standin",
        namespace: str | None = None,
        token: str | None = None,
        filename: str = "kubeconfig",
    ) -> Path:
        """Write a kubeconfig whose ``context`` (also the current one) points here."""
        cluster: JSON = {"server": self.url}
        if self.ca_cert_path is not None:
            cluster["certificate-authority-data"] = base64.b64encode(
                self.ca_cert_path.read_bytes()
            ).decode()
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": f"{context}-cluster", "cluster": cluster}],
            "users": [{"name": f"{context}-user", "user": {"token": token or self.token}}],
            "contexts": [
                {
                    "name": context,
                    "context": {
                        "cluster": f"{context}-cluster",
                        "user": f"{context}-user",
                        "namespace": namespace or self.namespace,
                    },
                }
            ],
            "current-context": context,
            "preferences": {},
        }
        path = Path(directory) / filename
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def write_incluster_files(self, directory: Path) -> dict[str, str]:
        """Write the service-account ``token`` and ``ca.crt`` files in ``directory`` and return
        the environment in-cluster config reads, for ``InClusterConfigLoader(token_filename=...,
        cert_filename=..., environ=...)``. Needs ``tls=True``: in-cluster config is HTTPS only."""
        if self.ca_cert_path is None:
            raise RuntimeError("in-cluster config needs KubernetesStandin(tls=True), started")
        directory = Path(directory)
        (directory / "token").write_text(self.token)
        (directory / "namespace").write_text(self.namespace)
        shutil.copyfile(self.ca_cert_path, directory / "ca.crt")
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port)}

    def add_token(
        self, token: str, *, namespaces: Iterable[str] | None = None, user: str = "limited"
    ) -> None:
        """Accept another token; limited to ``namespaces`` it gets RBAC's 403 elsewhere."""
        self.gate.add_token(token, user, None if namespaces is None else frozenset(namespaces))

    # -- failure injection --------------------------------------------------------------------

    def fail_next(
        self,
        status: int,
        *,
        count: int = 1,
        method: str | None = None,
        path_prefix: str | None = None,
        retry_after: int | None = None,
        message: str | None = None,
        delay: float = 0.0,
        after: bool = False,
    ) -> None:
        """Answer the next ``count`` requests matching ``method`` and ``path_prefix`` (the URL
        path, e.g. ``/apis/batch/v1/namespaces/default/jobs``) with ``status`` and its Status
        body (429 gets ``Retry-After``, 1 s unless ``retry_after`` says otherwise); ``after``:
        only once each request was served (its answer lost)."""
        if status == 429 and retry_after is None:
            retry_after = 1
        rule = FailureRule(status, count, delay, method, path_prefix, retry_after, message)
        rule.served = 1.0 if after else 0.0
        self.gate.add_rule(rule)

    def fail_randomly(
        self,
        status: int | Sequence[int],
        *,
        rate: float,
        method: str | None = None,
        path_prefix: str | None = None,
        seed: int | None = None,
        served: float = 0.0,
    ) -> None:
        """Answer each request matching ``method`` and ``path_prefix`` with ``status`` (or one
        of several, drawn each time) with probability ``rate`` (a flaky API server), until
        ``clear_failures``; ``served``: the share of those failures answered only after the
        request was served (its answer lost); ``seed`` makes the draws repeatable."""
        statuses = (status,) if isinstance(status, int) else tuple(status)
        rule = FailureRule(
            statuses[0],
            sys.maxsize,
            method=method,
            path_prefix=path_prefix,
            rate=rate,
            rng=random.Random(seed),
            statuses=statuses,
            served=served,
        )
        self.gate.add_rule(rule)

    def delay_next(
        self,
        seconds: float,
        *,
        count: int = 1,
        method: str | None = None,
        path_prefix: str | None = None,
    ) -> None:
        """Hold the next ``count`` matching requests for ``seconds``, then serve them."""
        self.gate.add_rule(FailureRule(None, count, seconds, method, path_prefix))

    def clear_failures(self) -> None:
        self.gate.clear_rules()

    # -- inspection ---------------------------------------------------------------------------

    def requests(
        self, method: str | None = None, path_prefix: str | None = None
    ) -> list[RecordedRequest]:
        """The request log (Authorization headers left out), oldest first."""
        return [
            entry
            for entry in self.gate.requests()
            if (method is None or entry.method == method.upper())
            and (path_prefix is None or entry.path.startswith(path_prefix))
        ]

    def requests_containing(self, needle: str) -> list[RecordedRequest]:
        return [entry for entry in self.gate.requests() if entry.contains(needle)]

    def clear_requests(self) -> None:
        self.gate.clear_requests()

    def objects(self, plural: str, namespace: str | None = None) -> list[JSON]:
        """Stored objects of a resource (``jobs``, ``pods``, ``secrets``, ``events``, ...) as
        copies of the JSON the server keeps; ``namespace`` None: the default one, "*": all."""
        with self.store.lock:
            self.store.tick()
            chosen = None if namespace == "*" else (namespace or self.namespace)
            return [_copy(obj) for obj in self.store.items(plural, chosen)]

    def get(self, plural: str, name: str, namespace: str | None = None) -> JSON | None:
        with self.store.lock:
            self.store.tick()
            found = self.store.lookup(plural, namespace or self.namespace, name)
            return None if found is None else _copy(found)

    def jobs(self, namespace: str | None = None) -> list[JSON]:
        return self.objects("jobs", namespace)

    def secrets(self, namespace: str | None = None) -> list[JSON]:
        return self.objects("secrets", namespace)

    def network_policies(self, namespace: str | None = None) -> list[JSON]:
        return self.objects("networkpolicies", namespace)

    def pods(self, namespace: str | None = None, *, job: str | None = None) -> list[JSON]:
        pods = self.objects("pods", namespace)
        if job is None:
            return pods
        return [pod for pod in pods if pod["metadata"].get("labels", {}).get("job-name") == job]

    def events(self, namespace: str | None = None, *, involving: str | None = None) -> list[JSON]:
        events = self.objects("events", namespace)
        return [e for e in events if involving is None or e["involvedObject"]["name"] == involving]

    # -- driving the cluster ------------------------------------------------------------------

    @property
    def pod_start_delay(self) -> float | None:
        """Seconds new pods stay Pending before running; None: until ``run_job``."""
        return self.store.jobs.pod_start_delay

    @pod_start_delay.setter
    def pod_start_delay(self, seconds: float | None) -> None:
        self.store.jobs.pod_start_delay = seconds

    def add_namespace(self, name: str) -> None:
        self.store.add_namespace(name)

    def advance(self, seconds: float) -> None:
        """Move simulated time on: pod start delays, ``activeDeadlineSeconds``, TTLs and
        ``gc_delay`` act as if ``seconds`` had passed."""
        with self.store.lock:
            self.store.clock.skew += seconds
            self.store.tick()

    def job_pod(self, job: str, namespace: str | None = None) -> str:
        """The name of the Job's newest pod (the active one while it runs)."""
        with self.store.lock:
            return str(self._job_pod(job, namespace)["metadata"]["name"])

    def _job_pod(self, job: str, namespace: str | None) -> JSON:
        self.store.tick()
        owner = self.store.live("jobs", namespace or self.namespace, job)
        pods = self.store.jobs.job_pods(owner)
        if not pods:
            raise LookupError(f"job {job!r} has no pod")
        return max(
            pods,
            key=lambda pod: (
                pod["status"].get("phase") in ("Pending", "Running"),
                int(pod["metadata"]["resourceVersion"]),
            ),
        )

    def run_job(self, job: str, namespace: str | None = None) -> None:
        """Start the Job's pending pod: phase Running, containers running and ready (and its
        command played, with ``run_commands``)."""
        with self.store.lock:
            pod = self._job_pod(job, namespace)
            if pod["status"].get("phase") == "Pending":
                self.store.runtime[
                    (pod["metadata"]["namespace"], pod["metadata"]["name"])
                ].start_at = None
                self.store.jobs.run_pod(pod)
                if self.store.jobs.run_commands:
                    self.store.jobs.play_command(pod)

    def succeed_job(
        self, job: str, namespace: str | None = None, *, log: str | None = None
    ) -> None:
        """The Job's pod exits 0 (started first if needed); the Job completes."""
        self._end_pod(job, namespace, exit_code=0, log=log)

    def fail_pod(
        self,
        job: str,
        namespace: str | None = None,
        *,
        exit_code: int = 1,
        log: str | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        """The Job's pod exits non-zero; the Job retries while ``backoffLimit`` allows, as the
        job controller does, and fails with BackoffLimitExceeded after that."""
        self._end_pod(job, namespace, exit_code=exit_code, log=log, reason=reason, message=message)

    def fail_job(
        self,
        job: str,
        namespace: str | None = None,
        *,
        reason: str = "BackoffLimitExceeded",
        exit_code: int = 1,
        log: str | None = None,
    ) -> None:
        """Fail the Job now whatever its backoffLimit: ``BackoffLimitExceeded`` after its pod
        exits ``exit_code``; ``DeadlineExceeded`` deletes its running pod as the controller does."""
        with self.store.lock:
            owner = self.store.live("jobs", namespace or self.namespace, job)
            if reason != "DeadlineExceeded":
                pod = self._job_pod(job, namespace)
                self._set_log(pod, log)
                if pod["status"].get("phase") in ("Pending", "Running"):
                    if pod["status"].get("phase") == "Pending":
                        self.store.jobs.run_pod(pod)
                    self.store.jobs.terminate_pod(pod, exit_code, account=False)
                    owner["status"]["failed"] = owner["status"].get("failed", 0) + 1
            message = FAILED_MESSAGES.get(reason, f"Job failed: {reason}")
            self.store.jobs.finish(owner, "Failed", reason, message)

    def _end_pod(
        self,
        job: str,
        namespace: str | None,
        *,
        exit_code: int,
        log: str | None,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        with self.store.lock:
            pod = self._job_pod(job, namespace)
            self._set_log(pod, log)
            if pod["status"].get("phase") == "Pending":
                self.store.runtime[
                    (pod["metadata"]["namespace"], pod["metadata"]["name"])
                ].start_at = None
                self.store.jobs.run_pod(pod)
            self.store.jobs.terminate_pod(pod, exit_code, reason, message)

    def stick_image_pull(
        self,
        job: str,
        namespace: str | None = None,
        *,
        reason: str = "ErrImagePull",
        message: str | None = None,
    ) -> None:
        """The Job's pod cannot pull its image: Pending, container waiting with ``reason``
        (``ErrImagePull`` or ``ImagePullBackOff``), and the kubelet's Warning events."""
        with self.store.lock:
            pod = self._job_pod(job, namespace)
            image = pod["spec"]["containers"][0]["image"]
            if message is None and reason == "ImagePullBackOff":
                message = f'Back-off pulling image "{image}"'
            elif message is None:
                message = (
                    f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}": '
                    f'failed to resolve reference "{image}": {image}: not found'
                )
            self.store.jobs.fail_image_pull(pod, reason, message)

    def set_log(
        self,
        text: str,
        *,
        job: str | None = None,
        pod: str | None = None,
        namespace: str | None = None,
    ) -> None:
        """Set what ``read_namespaced_pod_log`` returns for a pod, or for the Job's pods."""
        with self.store.lock:
            self.store.tick()
            ns = namespace or self.namespace
            if pod is not None:
                targets = [self.store.live("pods", ns, pod)]
            elif job is not None:
                targets = self.store.jobs.job_pods(self.store.live("jobs", ns, job))
            else:
                raise TypeError("set_log needs job= or pod=")
            for target in targets:
                self._set_log(target, text)

    def _set_log(self, pod: JSON, text: str | None) -> None:
        if text is not None:
            self.store.runtime[(pod["metadata"]["namespace"], pod["metadata"]["name"])].log = text

    def set_exec_handler(
        self,
        handler: ExecHandler,
        *,
        job: str | None = None,
        pod: str | None = None,
        namespace: str | None = None,
    ) -> None:
        """Who answers exec: for one pod, for every pod of a Job, or (neither) for all pods.
        A handler takes the argv and returns ``ExecResult`` or ``(stdout, stderr, exit_code)``."""
        with self.store.lock:
            ns = namespace or self.namespace
            if pod is not None:
                self.store.live("pods", ns, pod)
                self.store.runtime[(ns, pod)].exec_handler = handler
            elif job is not None:
                self.store.job_exec[(ns, job)] = handler
            else:
                self.store.default_exec = handler

    def set_resource_quota(
        self,
        name: str,
        hard: dict[str, str],
        used: dict[str, str] | None = None,
        namespace: str | None = None,
    ) -> JSON:
        """Create or replace a ResourceQuota (``spec.hard``, ``status.hard``/``status.used``)."""
        ns = namespace or self.namespace
        with self.store.lock:
            self.store.require_namespace(ns)
            status = {
                "hard": dict(hard),
                "used": dict(used) if used is not None else dict.fromkeys(hard, "0"),
            }
            existing = self.store.lookup("resourcequotas", ns, name)
            if existing is not None:
                existing.update({"spec": {"hard": dict(hard)}, "status": status})
                return _copy(self.store.save("resourcequotas", existing))
            quota = {
                "metadata": {"name": name, "namespace": ns},
                "spec": {"hard": dict(hard)},
                "status": status,
            }
            return _copy(self.store.insert("resourcequotas", quota))


def _copy(obj: JSON) -> JSON:
    return copy.deepcopy(obj)
