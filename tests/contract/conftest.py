"""Providers under contract. A new provider joins the suite by adding a ProviderCase."""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.providers.agentrun import AgentRunProvider
from corral.providers.base import SandboxProvider, SupportsCodeInterpreter
from corral.providers.credentials import CredentialResolver
from corral.providers.daytona.provider import DaytonaProvider
from corral.providers.docker.provider import DockerProvider
from corral.providers.e2b import E2BProvider
from corral.providers.kubernetes.provider import KubernetesProvider
from corral.providers.local.provider import LocalProvider
from corral.providers.modal import ModalProvider
from corral.providers.testing import InMemoryCodeInterpreter, InMemoryProvider
from corral.providers.vercel import VercelProvider
from tests.conftest import require
from tests.standins.e2b import CommandCall

READY_LINE = "corral-contract-ready"


@dataclass(frozen=True)
class ProviderCase:
    name: str
    provider_class: type[SandboxProvider]
    # Builds the provider from a scratch directory it may use and the test environment
    # (``docker_url`` and ``docker_image`` for cases that need a Docker Engine).
    build: Callable[[Path, dict[str, str]], SandboxProvider]
    # provider_options for a sandbox that prints READY_LINE and then keeps running.
    long_running_options: dict[str, Any]
    # provider_options for a sandbox that exits at once with code 3.
    exiting_options: dict[str, Any] | None
    needs_bwrap: bool = False
    needs_docker: bool = False
    needs_runsc: bool = False  # the engine has gVisor's runsc registered
    needs_e2b: bool = False
    needs_daytona: bool = False
    needs_kubernetes: bool = False
    needs_vercel: bool = False
    needs_modal: bool = False
    needs_agentrun: bool = False


LONG_RUNNING_COMMAND = ["sh", "-c", f"echo {READY_LINE}; exec sleep 300"]
EXITING_COMMAND = ["sh", "-c", "exit 3"]


def _e2b(root: Path, env: dict[str, str]) -> E2BProvider:
    provider = E2BProvider(
        {
            "api_url": env["e2b_api_url"],
            "sandbox_url": env["e2b_sandbox_url"],
            "deployment": f"contract-{abs(hash(root)) % 10**10}",
            "request_timeout_s": 10,
        }
    )
    provider.use_credentials(CredentialResolver(environ={"CORRAL_E2B_API_KEY": env["e2b_key"]}))
    return provider


def _daytona(root: Path, env: dict[str, str]) -> DaytonaProvider:
    provider = DaytonaProvider(
        {
            "api_url": env["daytona_api_url"],
            "deployment": f"contract-{abs(hash(root)) % 10**10}",
            "request_timeout_s": 10,
        }
    )
    resolver = CredentialResolver(environ={"CORRAL_DAYTONA_API_KEY": env["daytona_key"]})
    provider.use_credentials(resolver)
    return provider


def _agentrun(root: Path, env: dict[str, str]) -> AgentRunProvider:
    provider = AgentRunProvider(
        {"data_endpoint": env["agentrun_endpoint"], "account_id": env["agentrun_account"]}
    )
    key = env["agentrun_key"]
    provider.use_credentials(CredentialResolver(environ={"CORRAL_AGENTRUN_API_KEY": key}))
    return provider


def _kubernetes(root: Path, env: dict[str, str]) -> KubernetesProvider:
    return KubernetesProvider(
        {
            "kubeconfig": env["kubeconfig"],
            "context": env["context"],
            "namespace": "corral",
            "deployment": f"contract-{abs(hash(root)) % 10**10}",
            "request_timeout_s": 10,
        }
    )


def _vercel(root: Path, env: dict[str, str]) -> VercelProvider:
    provider = VercelProvider(
        {
            "api_url": env["vercel_url"],
            "team_id": env["vercel_team"],
            "project_id": env["vercel_project"],
            "deployment": f"contract-{abs(hash(root)) % 10**10}",
            "request_timeout_s": 10,
        }
    )
    token = {"CORRAL_VERCEL_API_KEY": env["vercel_token"]}
    provider.use_credentials(CredentialResolver(environ=token))
    return provider


def _modal(root: Path, env: dict[str, str]) -> ModalProvider:
    provider = ModalProvider(
        {
            "server_url": env["modal_url"],
            "deployment": f"contract-{abs(hash(root)) % 10**10}",
            "request_timeout_s": 10,
            "create_timeout_s": 10,
        }
    )
    provider.use_credentials(CredentialResolver(environ={"CORRAL_MODAL_API_KEY": env["modal_key"]}))
    return provider


CASES = [
    ProviderCase(
        "in-memory",
        InMemoryProvider,
        lambda root, env: InMemoryProvider(),
        {"log_lines": [READY_LINE]},
        {"exit_code": 3},
    ),
    ProviderCase(
        "local-bwrap",
        LocalProvider,
        lambda root, env: LocalProvider({"root_dir": root, "isolation": "required"}),
        {"command": LONG_RUNNING_COMMAND},
        {"command": EXITING_COMMAND},
        needs_bwrap=True,
    ),
    ProviderCase(
        "local-plain",
        LocalProvider,
        lambda root, env: LocalProvider({"root_dir": root, "isolation": "required"}),
        {"command": LONG_RUNNING_COMMAND},
        {"command": EXITING_COMMAND},
    ),
    ProviderCase(
        "docker",
        DockerProvider,
        lambda root, env: DockerProvider(
            {
                "base_url": env["docker_url"],
                "image": env["docker_image"],
                "network": "host",
                "grace_period_s": 1,
                "deployment": f"contract-{abs(hash(root)) % 10**10}",
            }
        ),
        {"command": LONG_RUNNING_COMMAND},
        {"command": EXITING_COMMAND},
        needs_docker=True,
    ),
    ProviderCase(
        "docker-runsc",
        DockerProvider,
        lambda root, env: DockerProvider(
            {
                "base_url": env["docker_url"],
                "image": env["docker_image"],
                "runtime": "runsc",
                "network": "none",
                "grace_period_s": 1,
                "deployment": f"contract-{abs(hash(root)) % 10**10}",
            }
        ),
        {"command": LONG_RUNNING_COMMAND},
        {"command": EXITING_COMMAND},
        needs_docker=True,
        needs_runsc=True,
    ),
    ProviderCase(
        "e2b",
        E2BProvider,
        _e2b,
        {},
        None,  # an E2B sandbox does not end when a process in it does
        needs_e2b=True,
    ),
    ProviderCase(
        "daytona",
        DaytonaProvider,
        _daytona,
        {"command": LONG_RUNNING_COMMAND},  # run for real by the stand-in
        {"command": EXITING_COMMAND},  # the runner's exit ends the sandbox's status
        needs_daytona=True,
    ),
    ProviderCase(
        "kubernetes",
        KubernetesProvider,
        _kubernetes,
        {"command": LONG_RUNNING_COMMAND},
        {"command": EXITING_COMMAND},
        needs_kubernetes=True,
    ),
    ProviderCase(
        "vercel",
        VercelProvider,
        _vercel,
        {"command": LONG_RUNNING_COMMAND},
        {"command": EXITING_COMMAND},  # the entry command's end is the sandbox's status
        needs_vercel=True,
    ),
    ProviderCase(
        "modal",
        ModalProvider,
        _modal,
        {"command": LONG_RUNNING_COMMAND},
        None,  # Modal lists running sandboxes only: an ended one is not in the inventory
        needs_modal=True,
    ),
    # Code interpreters: no runner sandbox, so only their code-interpreter part applies.
    ProviderCase(
        "in-memory-code",
        InMemoryCodeInterpreter,
        lambda root, env: InMemoryCodeInterpreter(),
        {},
        None,
    ),
    ProviderCase("agentrun", AgentRunProvider, _agentrun, {}, None, needs_agentrun=True),
]


def contract_shell(call: CommandCall) -> tuple[str, str, int]:
    """The few commands the contract runs, as a shell in a remote sandbox would answer."""
    argv = shlex.split(call.cmd)
    name, args = (argv[0], argv[1:]) if argv else ("", [])
    if name == "echo":
        return " ".join(args) + "\n", "", 0
    if name == "env":
        return "".join(f"{k}={v}\n" for k, v in sorted(call.environment.items())), "", 0
    if name == "cat":
        return "", f"cat: {' '.join(args)}: No such file or directory\n", 1
    return "", f"bash: line 1: {name}: command not found\n", 127


def cases_with(ability: type | None = None) -> list[Any]:
    """pytest params for the cases whose provider class implements ``ability``. The
    abilities of runner sandboxes (and no ability: the lifecycle) are asked of the providers
    that make them, every case but the code interpreters."""
    chosen = [
        c
        for c in CASES
        if (ability is None or issubclass(c.provider_class, ability))
        and (ability is SupportsCodeInterpreter) == is_interpreter(c)
    ]
    return [pytest.param(c, id=c.name) for c in chosen]


def all_cases() -> list[Any]:
    return [pytest.param(c, id=c.name) for c in CASES]


def is_interpreter(case: ProviderCase) -> bool:
    return issubclass(case.provider_class, SupportsCodeInterpreter)


@pytest.fixture
def provider_for(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[ProviderCase], SandboxProvider]]:
    """Builds the case's provider; terminates whatever it still owns at teardown."""
    built: list[SandboxProvider] = []

    def build(case: ProviderCase) -> SandboxProvider:
        if case.needs_bwrap:
            require(shutil.which("bwrap") is not None, "bubblewrap")
        env: dict[str, str] = {}
        if case.needs_docker:
            fixture = "docker_runsc" if case.needs_runsc else "docker_sandbox"
            engine = request.getfixturevalue(fixture)
            env = {"docker_url": engine.url, "docker_image": engine.image}
        if case.needs_kubernetes:
            standin = request.getfixturevalue("kubernetes_standin")
            kubeconfig = standin.write_kubeconfig(tmp_path, context="contract")
            env = {"kubeconfig": str(kubeconfig), "context": "contract"}
        if case.needs_e2b:
            standin = request.getfixturevalue("e2b_standin")
            standin.on_command(contract_shell)
            env = {
                "e2b_api_url": standin.api_url,
                "e2b_sandbox_url": standin.sandbox_url,
                "e2b_key": standin.api_key,
            }
        if case.needs_vercel:
            standin = request.getfixturevalue("vercel_standin")
            env = {
                "vercel_url": standin.base_url,
                "vercel_team": standin.team_id,
                "vercel_project": standin.project_id,
                "vercel_token": standin.token,
            }
        if case.needs_modal:
            standin = request.getfixturevalue("modal_standin")
            env = {"modal_url": standin.server_url, "modal_key": standin.api_key}
        if case.needs_daytona:
            standin = request.getfixturevalue("daytona_standin")
            env = {"daytona_api_url": standin.api_url, "daytona_key": standin.api_key}
        if case.needs_agentrun:
            from tests.standins.agentrun import ACCESS_KEY_ID, ACCESS_KEY_SECRET, ACCOUNT_ID

            standin = request.getfixturevalue("agentrun_standin")
            env = {
                "agentrun_endpoint": standin.endpoint,
                "agentrun_account": ACCOUNT_ID,
                "agentrun_key": f"{ACCESS_KEY_ID}:{ACCESS_KEY_SECRET}",
            }
        provider = case.build(tmp_path / "root", env)
        built.append(provider)
        return provider

    yield build
    for provider in built:
        for managed in getattr(provider, "list_managed", list)():
            provider.terminate(managed.handle)
