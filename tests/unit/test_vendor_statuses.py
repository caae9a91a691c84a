"""One answer per HTTP status, for every built-in provider that reads statuses: each provider's
own error translation, fed the error its SDK makes of that status (through the SDK's own
status-to-exception mapping where it has one), gives the status table's answer."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import docker.errors
import httpx2
import pytest
import requests
from agentrun.utils.exception import HTTPError
from daytona.common.errors import create_daytona_error
from e2b.api import api_exception_from_code
from grpclib import GRPCError, Status
from kubernetes.client.exceptions import ApiException
from modal._grpc_client import grpc_error_to_modal_exception
from vercel.sandbox.sync import SandboxApiError

from corral.providers.agentrun import AgentRunProvider
from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.configs.docker import DockerProviderOptions
from corral.providers.daytona.provider import DaytonaProvider
from corral.providers.docker.provider import DockerProvider
from corral.providers.e2b import E2BProvider
from corral.providers.errors import (
    CredentialRejectedError,
    ProviderError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxCreateError,
    SandboxNotRunningError,
)
from corral.providers.kubernetes.provider import KubernetesProvider
from corral.providers.modal import ModalProvider
from corral.providers.vendor import RATE_LIMITED, STATUS_ANSWERS, StatusAnswer, status_answer
from corral.providers.vercel import VercelProvider

STATUSES = (401, 403, 404, 408, 409, 429, 500, 502, 503, 504)

# The decision, stated again here so that a change to the table is a change to this test too.
EXPECTED = {
    401: StatusAnswer.CREDENTIAL_REJECTED,
    403: StatusAnswer.CREDENTIAL_REJECTED,
    404: StatusAnswer.NOT_FOUND,
    408: StatusAnswer.TRANSIENT,
    409: StatusAnswer.TRANSIENT,
    429: StatusAnswer.TRANSIENT,
    500: StatusAnswer.TRANSIENT,
    502: StatusAnswer.TRANSIENT,
    503: StatusAnswer.TRANSIENT,
    504: StatusAnswer.TRANSIENT,
}
ERRORS = {
    StatusAnswer.CREDENTIAL_REJECTED: CredentialRejectedError,
    StatusAnswer.NOT_FOUND: SandboxNotRunningError,
    StatusAnswer.TRANSIENT: ProviderUnavailableError,
    StatusAnswer.REFUSED: SandboxCreateError,
}

# Modal speaks gRPC: the codes standing for each HTTP status (grpc-gateway's mapping). gRPC
# has no code for 408 or 502.
GRPC = {
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.NOT_FOUND,
    409: Status.ABORTED,
    429: Status.RESOURCE_EXHAUSTED,
    500: Status.INTERNAL,
    503: Status.UNAVAILABLE,
    504: Status.DEADLINE_EXCEEDED,
}


def caught(translation: Callable[[], None]) -> ProviderError:
    with pytest.raises(ProviderError) as raised:
        translation()
    return raised.value


def e2b(status: int, creating: bool) -> ProviderError:
    provider = E2BProvider()

    def fail() -> None:
        with provider._sdk_errors("reading a sandbox", "acme", creating=creating):
            raise api_exception_from_code(status, "the vendor's words")

    return caught(fail)


def modal(status: int, creating: bool) -> ProviderError:
    provider = ModalProvider()

    def fail() -> None:
        with provider._sdk_errors("reading a sandbox", "acme", 1.0, creating=creating):
            raise grpc_error_to_modal_exception(GRPCError(GRPC[status], "the vendor's words"))

    return caught(fail)


def daytona(status: int, creating: bool) -> ProviderError:
    provider = DaytonaProvider()

    def fail() -> None:
        with provider._sdk_errors("reading a sandbox", "acme", creating=creating):
            raise create_daytona_error("the vendor's words", status_code=status)

    return caught(fail)


def vercel(status: int, creating: bool) -> ProviderError:
    provider = VercelProvider({"team_id": "team_1", "project_id": "prj_1"})

    def fail() -> None:
        with provider._sdk_errors("reading a sandbox", "acme", creating=creating):
            raise SandboxApiError(httpx2.Response(status), "the vendor's words")

    return caught(fail)


def agentrun(status: int, creating: bool) -> ProviderError:
    # Its create answers a 404 itself, naming the missing template (SandboxCreateError; see
    # tests/integration/test_agentrun_provider.py); every other call is translated here.
    provider = AgentRunProvider({"account_id": "1234"})
    return provider._mapped(HTTPError(status, "the vendor's words"), "reading a sandbox", "acme")


def kubernetes(status: int, creating: bool) -> ProviderError:
    provider = KubernetesProvider()

    def fail() -> None:
        with provider._api_errors("reading a job", creating=creating):
            raise ApiException(status=status, reason="the API's words")

    return caught(fail)


IMAGE = "corral-sandbox"
SPEC = SandboxSpec.model_validate(
    {
        "work_item_id": "wi-1",
        "sandbox_id": "sbx",
        "org_id": "acme",
        "project_id": "web",
        "registration_token": "crt_test",
        "control_url": "http://127.0.0.1:9",
    }
)


class _Engine:
    """A Docker Engine whose every answer is ``error`` (made by the SDK's own mapping of an
    HTTP status to its exceptions)."""

    def __init__(self, error: docker.errors.APIError) -> None:
        self.containers = self
        self.images = self
        self._error = error

    def get(self, name: str) -> Any:
        if name == IMAGE:  # runs as a user of its own (nothing asked of the engine)
            return SimpleNamespace(attrs={"Config": {"User": "10001:10001"}})
        raise self._error

    def create(self, **args: Any) -> Any:
        raise self._error


def docker_engine(status: int, creating: bool) -> ProviderError:
    response = requests.Response()
    response.status_code = status
    response.reason = "the engine's words"
    error = None
    try:  # the SDK's own mapping raises the error it makes of the status
        docker.errors.create_api_error_from_http_exception(
            requests.HTTPError("the engine's words", response=response)
        )
    except docker.errors.APIError as made:
        error = made
    assert error is not None and error.status_code == status
    provider = DockerProvider({"image": IMAGE})
    provider._client = _Engine(error)  # type: ignore[assignment]
    handle = SandboxHandle(provider_id="docker", external_id="corral-sbx")

    def fail() -> None:
        if creating:
            provider._create(SPEC, DockerProviderOptions(), IMAGE, None)
        else:
            provider._running(handle)

    return caught(fail)


PROVIDERS: dict[str, Callable[[int, bool], ProviderError]] = {
    "docker": docker_engine,
    "e2b": e2b,
    "modal": modal,
    "daytona": daytona,
    "vercel": vercel,
    "agentrun": agentrun,
    "kubernetes": kubernetes,
}


def test_the_table_gives_the_decided_answers() -> None:
    assert {status: status_answer(status) for status in STATUSES} == EXPECTED
    assert status_answer(400) is StatusAnswer.REFUSED and status_answer(422).error() is (
        SandboxCreateError
    )
    assert status_answer(410) is StatusAnswer.NOT_FOUND
    assert all(status < 500 for status in STATUS_ANSWERS)  # every 5xx is transient


# Every provider with every status its API can answer (gRPC, modal's, has no 408 or 502).
CASES = [
    (provider, status)
    for provider in sorted(PROVIDERS)
    for status in STATUSES
    if provider != "modal" or status in GRPC
]


# The vendors' 429 is a rate limit or quota of their own: transient, and a paced provider's
# items wait for their pace (worker/pacing.py). The engines' (docker, kubernetes) retry it.
VENDORS = {"e2b", "modal", "daytona", "vercel", "agentrun"}


@pytest.mark.parametrize(("provider", "status"), CASES)
def test_every_provider_gives_the_one_answer(provider: str, status: int) -> None:
    error = PROVIDERS[provider](status, False)
    answer = EXPECTED[status]
    rate_limited = status == RATE_LIMITED and provider in VENDORS
    assert type(error) is (RateLimitedError if rate_limited else ERRORS[answer]), error.message
    assert error.retryable is (answer is StatusAnswer.TRANSIENT)
    if answer is StatusAnswer.CREDENTIAL_REJECTED and provider not in {"kubernetes", "docker"}:
        # The one message: which credential to fix, and how.
        assert f"corral credentials set --org acme --provider {provider}" in error.message
        assert f"CORRAL_{provider.upper()}_API_KEY" in error.message


@pytest.mark.parametrize("provider", sorted(set(PROVIDERS) - {"agentrun"}))
def test_what_is_not_found_while_creating_is_a_create_error(provider: str) -> None:
    error = PROVIDERS[provider](404, True)
    assert type(error) is SandboxCreateError and not error.retryable
