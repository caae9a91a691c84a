"""The sandbox Job's manifest (corral.providers.kubernetes.objects.job_manifest), built
without any cluster: who its pod runs as."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from corral.providers.kubernetes.objects import (
    KubernetesProviderConfig,
    KubernetesProviderOptions,
    job_manifest,
)
from tests.conftest import SpecFactory


def _pod(make_spec: SpecFactory, **config: Any) -> dict[str, Any]:
    manifest = job_manifest(
        KubernetesProviderConfig(**config), make_spec(), KubernetesProviderOptions()
    )
    pod: dict[str, Any] = manifest["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize("restricted", [True, False])
def test_the_sandbox_pod_runs_as_10001_and_never_as_root(
    make_spec: SpecFactory, restricted: bool
) -> None:
    context = _pod(make_spec, restricted_pod_security=restricted)["securityContext"]
    assert (context["runAsNonRoot"], context["runAsUser"], context["runAsGroup"]) == (
        True,
        10001,
        10001,
    )


def test_the_sandbox_user_is_configurable_but_not_root(make_spec: SpecFactory) -> None:
    context = _pod(make_spec, sandbox_uid=20000, sandbox_gid=20001)["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"]) == (20000, 20001)
    with pytest.raises(ValidationError):
        KubernetesProviderConfig(sandbox_uid=0)


def test_the_restricted_container_cannot_gain_privileges(make_spec: SpecFactory) -> None:
    [container] = _pod(make_spec)["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
