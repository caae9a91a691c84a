"""The kubelet's part for corral's sandbox pods on the Kubernetes API stand-in: every pod that
starts gets a real runner (``python -m runner``) with its container's environment, the
``secretKeyRef`` read from the Secret at that moment (as a kubelet resolves it when it starts
the container); when the runner exits, the pod ends with its exit code.

The stand-in plays the job controller; this plays what happens inside the pod, so that a
dispatch through real processes goes all the way to the runner's register and complete."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.acceptance.stack import REPO
from tests.standins.kubernetes import KubernetesStandin
from tests.standins.kubernetes_api import ApiError

EXIT_REFUSED = 3  # the runner's exit code for a registration the control plane refused


@dataclass
class PodRun:
    """One runner started for one pod."""

    pod: str
    job: str
    token: str = field(repr=False)
    process: subprocess.Popen[bytes] = field(repr=False)
    log: Path
    exit_code: int | None = None


class RunnerKubelet:
    """Starts a runner for each started pod of the stand-in's namespace, from a thread."""

    def __init__(self, cluster: KubernetesStandin, workdir: Path, *, poll_s: float = 0.05):
        self.cluster = cluster
        self.workdir = workdir
        self.poll_s = poll_s
        self.runs: dict[str, PodRun] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="runner-kubelet", daemon=True)

    def __enter__(self) -> RunnerKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for run in self.finished_or_not():
            if run.process.poll() is None:
                run.process.kill()  # only the runners this kubelet started
            run.process.wait()

    def finished_or_not(self) -> list[PodRun]:
        with self._lock:
            return list(self.runs.values())

    def refused(self) -> list[PodRun]:
        """Runs whose registration the control plane refused."""
        return [run for run in self.finished_or_not() if run.exit_code == EXIT_REFUSED]

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            for pod in self.cluster.pods():
                name = pod["metadata"]["name"]
                if pod["status"].get("phase") == "Running" and name not in self.runs:
                    self._start(pod)
            for run in self.finished_or_not():
                if run.exit_code is None and run.process.poll() is not None:
                    self._end(run)

    def _start(self, pod: dict[str, Any]) -> None:
        env = self._container_env(pod)
        if env is None:
            return  # its Secret is not there (yet): a kubelet retries, so does this
        name = pod["metadata"]["name"]
        directory = self.workdir / name
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / "runner.log"
        process_env = {
            "PATH": os.environ["PATH"],
            "HOME": str(directory),
            "PYTHONPATH": str(REPO),
            **env,
        }
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "runner"],
                cwd=directory,
                env=process_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        job = pod["metadata"]["labels"]["job-name"]
        token = env["CORRAL_REGISTRATION_TOKEN"]
        with self._lock:
            self.runs[name] = PodRun(name, job, token, process, log)

    def _container_env(self, pod: dict[str, Any]) -> dict[str, str] | None:
        env: dict[str, str] = {}
        for entry in pod["spec"]["containers"][0].get("env") or []:
            ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                env[entry["name"]] = entry.get("value", "")
                continue
            secret = self.cluster.get("secrets", ref["name"], pod["metadata"]["namespace"])
            if secret is None or ref["key"] not in (secret.get("data") or {}):
                return None
            env[entry["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        return env

    def _end(self, run: PodRun) -> None:
        run.exit_code = run.process.returncode
        try:
            if run.exit_code == 0:
                self.cluster.succeed_job(run.job)
            else:
                self.cluster.fail_pod(run.job, exit_code=run.exit_code)
        except (ApiError, LookupError):
            pass  # deleted meanwhile (the control plane terminated it): nothing left to end
