"""A provision retried after a failure part-way (issue 13): the kubernetes provider through
corral.provision's own logic, on PostgreSQL, against the Kubernetes API stand-in.

Each attempt mints a new registration token and revokes the last one, so whatever a retry
reuses must carry the retry's token, never the revoked one: otherwise the runner is refused at
register and the item waits for nothing."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from corral.providers.base import SandboxState
from corral.providers.errors import ProviderUnavailableError
from corral.providers.kubernetes.provider import KubernetesProvider
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import AuthMode, Pool, RegistrationToken, Sandbox
from corral.shared.store.tokens import hash_token, redeem_registration_token
from corral.worker.provision import Outcome, RetryLater, provision_item
from tests.conftest import SpecFactory
from tests.standins.kubernetes import KubernetesStandin

TOKEN = "cluster-token-for-retry-tests"
NS = "corral"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"


@pytest.fixture
def k8s() -> Iterator[KubernetesStandin]:
    with KubernetesStandin(token=TOKEN, namespace=NS) as standin:
        yield standin


@pytest.fixture
def provider(k8s: KubernetesStandin, tmp_path: Path) -> Iterator[KubernetesProvider]:
    kubeconfig = k8s.write_kubeconfig(tmp_path, context="standin")
    config = {"kubeconfig": str(kubeconfig), "context": "standin", "namespace": NS}
    # Each call's own retries off: these failures are to reach the provision task's retry.
    made = KubernetesProvider({**config, "request_timeout_s": 5, "api_retries": 0})
    yield made
    made.close()


@pytest.fixture
def rt(fresh_pg_url: str, provider: KubernetesProvider, tmp_path: Path) -> Iterator[Runtime]:
    db = Database(make_engine(fresh_pg_url))
    runtime = Runtime(settings=CoreSettings(state_dir=tmp_path), db=db)
    runtime.use_provider(provider)
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with db.session() as session:
        pool = Pool(
            id="pool-k8s",
            org_id="acme",
            name="cluster",
            provider_id="kubernetes",
            max_concurrent=10,
        )
        session.add(pool)
    yield runtime
    db.dispose()


def routed_item(rt: Runtime) -> str:
    work = {"kind": "shell", "command": "echo hi"}
    request = DispatchRequest.model_validate(
        {"org": "acme", "project": "web", "profile": "default", "work": work}
    )
    item_id = accept(rt.db, request, actor="test").item_id
    assert (
        route_item(rt.db, item_id, actor="test", settings=rt.settings).queue
        == "provision.kubernetes"
    )
    return item_id


def secret_token(secret: dict[str, Any]) -> str:
    [value] = (secret.get("data") or {}).values()
    return base64.b64decode(value).decode()


def the_secret(k8s: KubernetesStandin) -> dict[str, Any]:
    [secret] = k8s.secrets()
    return secret


# -- through corral.provision ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("PATCH", JOBS), ("POST", POLICIES)],
    ids=["starting-the-job-fails", "creating-the-policy-fails"],
)
def test_a_retry_after_a_failure_past_the_secret_hands_the_runner_the_retrys_token(
    rt: Runtime, k8s: KubernetesStandin, method: str, path: str
) -> None:
    item_id = routed_item(rt)
    k8s.fail_next(500, method=method, path_prefix=path)
    k8s.fail_next(500, method="DELETE", path_prefix=JOBS, count=10)  # every clean-up fails
    with pytest.raises(RetryLater):
        provision_item(rt, item_id, actor="test")
    first = secret_token(the_secret(k8s))  # made before the failure; revoked by the release
    [job] = k8s.jobs()
    assert job["spec"]["suspend"] is True, "the failed attempt never started its Job"

    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED

    [job] = k8s.jobs()  # the same Job: the clean-up could not delete it
    assert job["spec"]["suspend"] is False
    secret = the_secret(k8s)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    token = secret_token(secret)
    assert token != first
    with rt.db.session() as session:
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        revoked = session.scalars(
            select(RegistrationToken).where(RegistrationToken.token_hash == hash_token(first))
        ).one()
        assert revoked.redeemed_at == revoked.expires_at, "the first attempt's token is revoked"
        # The runner's registration with what the Secret holds succeeds.
        redeemed = redeem_registration_token(session, token)
        assert redeemed is not None and redeemed.sandbox_id == sandbox.id


# -- the provider alone ---------------------------------------------------------------------


def test_a_suspended_job_whose_secret_holds_another_token_gets_a_secret_with_this_one(
    k8s: KubernetesStandin, provider: KubernetesProvider, make_spec: SpecFactory
) -> None:
    earlier = make_spec()
    k8s.fail_next(500, method="PATCH", path_prefix=JOBS)
    with pytest.raises(ProviderUnavailableError):
        provider.provision(earlier)
    retry = earlier.model_copy(update={"registration_token": make_spec().registration_token})

    handle = provider.provision(retry)

    assert secret_token(the_secret(k8s)) == retry.registration_token.get_secret_value()
    assert not k8s.requests_containing(earlier.registration_token.get_secret_value())[1:], (
        "the earlier token went out once, in the first Secret, and never again"
    )
    assert provider.status(handle).state is SandboxState.RUNNING


def test_a_started_job_whose_secret_holds_another_token_is_deleted_and_made_afresh(
    k8s: KubernetesStandin, provider: KubernetesProvider, make_spec: SpecFactory
) -> None:
    earlier = make_spec()
    first = provider.provision(earlier)  # started: its pod may hold the earlier token already
    uid = k8s.jobs()[0]["metadata"]["uid"]
    retry = earlier.model_copy(update={"registration_token": make_spec().registration_token})

    with pytest.raises(ProviderUnavailableError, match="earlier"):
        provider.provision(retry)
    assert k8s.jobs() == [] and k8s.secrets() == [] and k8s.pods() == []

    assert provider.provision(retry) == first
    [job] = k8s.jobs()
    assert job["metadata"]["uid"] != uid and job["spec"]["suspend"] is False
    assert secret_token(the_secret(k8s)) == retry.registration_token.get_secret_value()
