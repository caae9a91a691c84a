"""The deployment files, checked offline: the Kubernetes manifests (deploy/kubernetes) against
the Kubernetes 1.31 schemas and KEDA's ScaledObject schema, their consistency with corral's
settings, queues and providers, docker-compose.yml through Debian's docker-compose, the
control-plane Dockerfile and the Makefile's targets. Nothing is applied, built or started.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from corral.shared.broker.queues import provider_queues, provision_queue
from corral.shared.settings import CoreSettings
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
RABBITMQ = KUBERNETES / "rabbitmq"  # the overlay: the same deployment on RabbitMQ
KEDA_SCHEMA = ROOT / "tests" / "data" / "keda-scaledobject-schema.json"
KUBERNETES_VERSION = "1.31"
KEDA_API_VERSION = "keda.sh/v1alpha1"
KUSTOMIZATION = "kustomization.yaml"
SECRET_TEMPLATE = "secret.example.yaml"
# The provider workers deployed on Kubernetes, one autoscaled Deployment each.
PROVIDERS = ("kubernetes", "e2b")
PLACEHOLDER = "CHANGE-ME"

# What providers/kubernetes/provider.py calls, by (API group, resource): the list in
# docs/providers/kubernetes.md.
PROVISION_RBAC = {
    ("batch", "jobs"): {"get", "list", "create", "patch", "delete"},
    ("", "pods"): {"get", "list"},
    ("", "pods/log"): {"get"},
    ("", "pods/exec"): {"create", "get"},
    ("", "secrets"): {"create", "get", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"create", "get", "delete"},
    ("", "events"): {"list"},
    ("", "resourcequotas"): {"get"},
}
# The reaper's calls: list_managed, status and terminate.
MAINTENANCE_RBAC = {
    ("batch", "jobs"): {"get", "list", "delete"},
    ("", "pods"): {"get", "list"},
    ("", "events"): {"list"},
}

Obj = dict[str, Any]


# -- loading -------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """Every YAML file under deploy/ but deploy/images/ (the sandbox image recipe),
    deploy/prometheus/ (alert rules: tests/unit/test_alert_rules.py) and the RabbitMQ
    overlay's patches (checked by the tests of that overlay)."""
    files = [
        path
        for pattern in ("*.yaml", "*.yml")
        for path in DEPLOY.rglob(pattern)
        if path.relative_to(DEPLOY).parts[0] not in ("images", "prometheus")
        and RABBITMQ not in path.parents
    ]
    return sorted(files)


def load(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def kubernetes_objects() -> tuple[tuple[str, Obj], ...]:
    """(file, object) for every object in the manifests; kustomization.yaml is kustomize's
    configuration, not an object. Read once: tests must not change what they get."""
    return tuple(
        (str(path.relative_to(ROOT)), obj)
        for path in manifest_files()
        if path.name != KUSTOMIZATION
        for obj in load(path)
    )


def applied_objects() -> list[Obj]:
    """The objects `kubectl apply -k deploy/kubernetes` makes: the secret template is not."""
    return [obj for path, obj in kubernetes_objects() if Path(path).name != SECRET_TEMPLATE]


def of_kind(kind: str) -> list[Obj]:
    return [obj for obj in applied_objects() if obj["kind"] == kind]


def one(kind: str, name: str) -> Obj:
    found = [obj for obj in of_kind(kind) if obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Obj) -> Iterator[Obj]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def config_data() -> dict[str, str]:
    data: dict[str, str] = one("ConfigMap", "corral")["data"]
    return data


def worker(provider: str) -> Obj:
    return one("Deployment", f"corral-worker-{provider}")


def settings_from_config_map(monkeypatch: pytest.MonkeyPatch) -> CoreSettings:
    """corral's settings as a pod with the ConfigMap in its environment reads them."""
    for name in list(os.environ):
        if name.startswith("CORRAL_"):
            monkeypatch.delenv(name)
    for name, value in config_data().items():
        monkeypatch.setenv(name, value)
    return CoreSettings()


def strict(schema: Any) -> Any:
    """A CRD schema as the API server applies it with strict field validation (kubectl's
    default): an object with declared properties admits no others."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        result["additionalProperties"] = False
    return result


# -- the Kubernetes manifests --------------------------------------------------------------


def test_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    (kustomization,) = load(KUBERNETES / KUSTOMIZATION)
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    files = {path.name for path in KUBERNETES.glob("*.yaml")} - {KUSTOMIZATION, SECRET_TEMPLATE}
    assert set(listed) == files
    assert SECRET_TEMPLATE not in listed  # applying it would overwrite the real Secret
    (image,) = kustomization["images"]
    assert image["name"] == "corral"


def test_every_object_validates_against_the_kubernetes_schemas_but_keda_s() -> None:
    try:
        import kubernetes_validate
    except ImportError:
        require(False, "kubernetes-validate (pip install -e '.[dev]')")
    validated, skipped, errors = 0, [], []
    for path, obj in kubernetes_objects():
        where = f"{path}: {obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        if obj.get("apiVersion") == KEDA_API_VERSION:
            skipped.append(obj)  # a CRD: kubernetes-validate has no schema for it
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {str(exc).splitlines()[0]}")
        validated += 1
    assert errors == []
    assert validated >= 30
    assert {obj["kind"] for obj in skipped} == {"ScaledObject"}
    assert sorted(obj["metadata"]["name"] for obj in skipped) == sorted(
        f"corral-worker-{provider}" for provider in PROVIDERS
    )


def test_keda_scaled_objects_validate_against_the_crd_schema() -> None:
    try:
        import jsonschema
    except ImportError:
        require(False, "jsonschema (a dependency of kubernetes-validate)")
    schema = strict(json.loads(KEDA_SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    scaled = of_kind("ScaledObject")
    assert len(scaled) == len(PROVIDERS)
    for obj in scaled:
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
        assert errors == [], obj["metadata"]["name"]
    # The schema is strict: a misspelt field is an error, as the API server would say.
    bad = json.loads(json.dumps(scaled[0]))
    bad["spec"]["triggers"][0]["metdata"] = bad["spec"]["triggers"][0].pop("metadata")
    assert not validator.is_valid(bad)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_scaled_object_scales_its_provider_worker_on_its_queue(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_from_config_map(monkeypatch)
    scaled = one("ScaledObject", f"corral-worker-{provider}")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target.get("apiVersion"), target.get("kind")) == ("apps/v1", "Deployment")
    deployment = worker(provider)
    assert target["name"] == deployment["metadata"]["name"]
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it

    # Celery's Redis transport keeps a queue as the list named after it, prefixed.
    broker = urlsplit(settings.broker_url)
    assert broker.scheme == "redis"
    prefix = settings.broker_key_prefix
    lists = []
    for trigger in spec["triggers"]:
        assert trigger["type"] == "redis"
        meta = trigger["metadata"]
        assert meta["address"] == f"{broker.hostname}:{broker.port}"
        assert meta["databaseIndex"] == (broker.path.strip("/") or "0")
        assert int(meta["listLength"]) > 0
        lists.append(meta["listName"])
    assert lists[0] == prefix + provision_queue(provider, gpu=False)
    assert set(lists) <= {prefix + queue for queue in provider_queues(provider)}

    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["cooldownPeriod"] > 0
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_beat_is_one_replica_replaced_by_recreate() -> None:
    beat = one("Deployment", "corral-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    assert next(containers(beat))["args"] == ["beat"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_provider_workers_run_their_provider_and_outlast_a_provision(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_from_config_map(monkeypatch)
    deployment = worker(provider)
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert grace >= settings.provision_timeout_s >= 900
    (container,) = containers(deployment)
    args = container["args"]
    assert args[:3] == ["worker", "--provider", provider]
    assert args[args.index("--metrics-port") + 1] == "9302"
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
    # SIGTERM must stay Celery's warm shutdown, and no hook may cut it short.
    assert "lifecycle" not in container
    names = {env["name"] for env in container.get("env", [])}
    assert "REMAP_SIGTERM" not in names


def test_maintenance_worker_serves_its_metrics() -> None:
    (container,) = containers(one("Deployment", "corral-maintenance"))
    assert container["args"] == [
        "worker",
        "--maintenance",
        "--metrics-port",
        "9301",
        "--metrics-host",
        "0.0.0.0",
    ]


def test_every_container_has_resource_requests_and_limits() -> None:
    workloads = of_kind("Deployment") + of_kind("Job")
    assert len(workloads) >= 9
    for workload in workloads:
        for container in containers(workload):
            resources = container.get("resources", {})
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert {"cpu", "memory"} <= set(resources.get("limits", {})), where


def test_api_has_readiness_and_liveness_probes_and_is_what_sandboxes_may_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from corral.providers.kubernetes.objects import KubernetesProviderConfig

    api = one("Deployment", "corral-api")
    labels = api["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "corral-api"
    (container,) = containers(api)
    port = next(p for p in container["ports"] if p["name"] == "http")["containerPort"]
    assert port == 8300
    # Metrics on a port of their own, the one Prometheus is told to scrape, not the Service's.
    args = container["args"]
    metrics = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert args[args.index("--metrics-port") + 1] == str(metrics) == "9300"
    annotations = api["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9300"
    # Readiness reads the database and the broker; liveness only that the process serves.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"

    settings = settings_from_config_map(monkeypatch)
    assert (settings.api_host, settings.api_port) == ("0.0.0.0", 8300)
    service = one("Service", "corral-api")
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["port"] for p in service["spec"]["ports"]] == [8300]
    control = urlsplit(settings.control_url)
    namespace = api["metadata"]["namespace"]
    assert (control.hostname, control.port) == (f"corral-api.{namespace}.svc", 8300)

    # The kubernetes provider's NetworkPolicy lets sandboxes without network reach these pods.
    config = KubernetesProviderConfig.model_validate(settings.provider_config["kubernetes"])
    assert config.api_pod_selector.items() <= labels.items()
    assert config.api_namespace == namespace
    assert port in config.api_ports


def test_provider_configuration_in_the_config_map_is_valid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from corral.providers.registry import get_provider_class

    settings = settings_from_config_map(monkeypatch)
    assert set(settings.provider_config) == set(PROVIDERS)
    for provider, config in settings.provider_config.items():
        get_provider_class(provider).config_model.model_validate(config)
    kubernetes = settings.provider_config["kubernetes"]
    assert kubernetes["in_cluster"] is True
    quota = one("ResourceQuota", kubernetes["quota_name"])
    assert quota["metadata"]["namespace"] == kubernetes["namespace"]
    assert one("Namespace", kubernetes["namespace"])
    secret_names = set(load(KUBERNETES / SECRET_TEMPLATE)[0]["stringData"])
    # The broker URL is in both: the ConfigMap's Redis URL has no password, and the
    # RabbitMQ overlay's (which has one) comes from the Secret and overrides it.
    assert secret_names & set(config_data()) == {"CORRAL_BROKER_URL"}


def test_disruption_budgets_select_existing_deployments() -> None:
    deployments = of_kind("Deployment")
    covered = set()
    for budget in of_kind("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        matched = [
            d["metadata"]["name"]
            for d in deployments
            if d["metadata"]["namespace"] == budget["metadata"]["namespace"]
            and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, budget["metadata"]["name"]
        assert budget["spec"].get("maxUnavailable") == 1 or budget["spec"].get("minAvailable")
        covered.add(matched[0])
    wanted = {"corral-api", "corral-scheduler", "corral-maintenance"}
    wanted |= {f"corral-worker-{provider}" for provider in PROVIDERS}
    assert wanted <= covered
    assert "corral-beat" not in covered


def _grants(role: Obj) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert not rule.get("resourceNames")
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def _bound_accounts(role: Obj) -> set[tuple[str, str]]:
    name, namespace = role["metadata"]["name"], role["metadata"]["namespace"]
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    return {
        (subject["namespace"], subject["name"])
        for binding in of_kind("RoleBinding")
        if binding["metadata"]["namespace"] == namespace and binding["roleRef"] == ref
        for subject in binding["subjects"]
        if subject["kind"] == "ServiceAccount"
    }


def test_rbac_grants_the_kubernetes_provider_and_the_reaper_what_they_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sandboxes = settings_from_config_map(monkeypatch).provider_config["kubernetes"]["namespace"]
    assert not of_kind("ClusterRole") and not of_kind("ClusterRoleBinding")
    for role_name, deployment_name, wanted in (
        ("corral-provision", "corral-worker-kubernetes", PROVISION_RBAC),
        ("corral-maintenance", "corral-maintenance", MAINTENANCE_RBAC),
    ):
        role = one("Role", role_name)
        assert role["metadata"]["namespace"] == sandboxes
        assert _grants(role) == wanted, role_name
        deployment = one("Deployment", deployment_name)
        account = pod_spec(deployment)["serviceAccountName"]
        assert _bound_accounts(role) == {(deployment["metadata"]["namespace"], account)}
    # Only those two get a token at all.
    with_token = set()
    for deployment in of_kind("Deployment") + of_kind("Job"):
        spec = pod_spec(deployment)
        account = one("ServiceAccount", spec["serviceAccountName"])
        if spec.get("automountServiceAccountToken", account["automountServiceAccountToken"]):
            with_token.add(deployment["metadata"]["name"])
    assert with_token == {"corral-worker-kubernetes", "corral-maintenance"}


def test_secret_template_holds_placeholders_for_every_key_the_pods_read() -> None:
    (secret,) = load(KUBERNETES / SECRET_TEMPLATE)
    assert secret["kind"] == "Secret"
    values = secret["stringData"]
    assert all(PLACEHOLDER in value for value in values.values())
    read = set()
    for workload in of_kind("Deployment") + of_kind("Job"):
        for container in containers(workload):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"]
                    assert ref["key"] == env["name"]
                    read.add(ref["key"])
            assert not [s for s in container.get("envFrom", []) if "secretRef" in s]
    read |= {patch[0]["value"]["name"] for patch in rabbitmq_env_patches()}
    assert read == set(values)
    assert read == {
        "CORRAL_DATABASE_URL",
        "CORRAL_SECRET_KEY",
        "CORRAL_ADMIN_TOKEN",
        "CORRAL_E2B_API_KEY",
        "CORRAL_BROKER_URL",  # the RabbitMQ overlay's
        "FLOWER_BROKER_API",  # Flower's, on RabbitMQ (optional)
    }


# -- the RabbitMQ overlay ------------------------------------------------------------------


def rabbitmq_env_patches() -> list[list[Obj]]:
    (kustomization,) = load(RABBITMQ / KUSTOMIZATION)
    return [load(RABBITMQ / p["path"])[0] for p in kustomization["patches"] if "target" in p]


def test_the_rabbitmq_overlay_gives_every_corral_process_the_broker_from_the_secret() -> None:
    (kustomization,) = load(RABBITMQ / KUSTOMIZATION)
    assert kustomization["resources"] == ["..", "trigger-authentication.yaml"]
    for patch in kustomization["patches"]:
        assert (RABBITMQ / patch["path"]).is_file()
    targeted = {p["target"]["kind"] for p in kustomization["patches"] if "target" in p}
    assert targeted == {"Deployment", "Job"}
    for (operation,) in rabbitmq_env_patches():
        assert operation["op"] == "add"
        assert operation["path"] == "/spec/template/spec/containers/0/env/-"
        assert operation["value"]["valueFrom"]["secretKeyRef"]["key"] == "CORRAL_BROKER_URL"
    # The patch appends to each corral container's env list: every one has that list.
    removed = {(o["kind"], o["metadata"]["name"]) for o in load(RABBITMQ / "without-redis.yaml")}
    for workload in of_kind("Deployment") + of_kind("Job"):
        if (workload["kind"], workload["metadata"]["name"]) not in removed:
            assert "env" in pod_spec(workload)["containers"][0], workload["metadata"]["name"]
    # What the overlay removes is Redis, and it exists to be removed.
    assert {name for _, name in removed} == {"corral-redis"}
    for kind, name in removed:
        one(kind, name)


def test_the_rabbitmq_overlay_scales_each_provider_worker_on_its_rabbitmq_queues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import jsonschema

    validator = jsonschema.Draft7Validator(strict(json.loads(KEDA_SCHEMA.read_text())))
    (authentication,) = load(RABBITMQ / "trigger-authentication.yaml")
    (secret,) = load(KUBERNETES / SECRET_TEMPLATE)
    (target,) = authentication["spec"]["secretTargetRef"]
    assert (target["parameter"], target["name"]) == ("host", secret["metadata"]["name"])
    assert target["key"] in secret["stringData"]
    patches = load(RABBITMQ / "scale-on-rabbitmq.yaml")
    assert sorted(p["metadata"]["name"] for p in patches) == sorted(
        f"corral-worker-{provider}" for provider in PROVIDERS
    )
    for patch in patches:
        provider = patch["metadata"]["name"].removeprefix("corral-worker-")
        scaled = json.loads(json.dumps(one("ScaledObject", patch["metadata"]["name"])))
        scaled["spec"]["triggers"] = patch["spec"]["triggers"]  # a CRD's list is replaced
        assert [f"{e.path}: {e.message}" for e in validator.iter_errors(scaled)] == []
        triggers = scaled["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"rabbitmq"}
        assert [t["metadata"]["queueName"] for t in triggers] == provider_queues(provider)
        assert {t["authenticationRef"]["name"] for t in triggers} == {
            authentication["metadata"]["name"]
        }
        assert all(t["metadata"]["mode"] == "QueueLength" for t in triggers)
    # The ConfigMap's settings with the Secret's RabbitMQ URL are valid (no key prefix).
    settings_from_config_map(monkeypatch)
    monkeypatch.setenv("CORRAL_BROKER_URL", secret["stringData"]["CORRAL_BROKER_URL"])
    assert CoreSettings().broker_key_prefix == ""


# -- the image -----------------------------------------------------------------------------


def test_dockerfile_installs_corral_with_every_provider_and_runs_it_unprivileged() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["corral"]' in dockerfile
    assert "[docker,kubernetes,e2b,postgres]" in dockerfile
    assert re.search(r'"flower[>=<]', dockerfile)
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0].isdigit() and not users[-1].startswith("0")
    assert re.search(r"^STOPSIGNAL SIGTERM$", dockerfile, re.MULTILINE)
    # Every package pyproject.toml installs is copied in, with the folders corral's symlinks
    # point to, and the build context keeps them.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        pattern.rstrip("*")
        for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages == {"corral"}
    packages |= {link.name for link in (ROOT / "corral").iterdir() if link.is_symlink()}
    copied = set(re.findall(r"^COPY (\w+)/ /src/\1/$", dockerfile, re.MULTILINE))
    assert copied == packages
    kept = set(re.findall(r"^!(\S+?)/?$", (ROOT / ".dockerignore").read_text(), re.MULTILINE))
    assert packages | {"pyproject.toml", "README.md", "LICENSE"} <= kept


def test_no_deployment_file_makes_sigterm_a_cold_shutdown() -> None:
    setting = re.compile(r"REMAP_SIGTERM[\"']?\s*[:=]|name:\s*[\"']?REMAP_SIGTERM")
    for path in [*manifest_files(), DEPLOY / "Dockerfile", ROOT / "docker-compose.yml"]:
        assert not setting.search(path.read_text()), path


# -- docker-compose.yml --------------------------------------------------------------------

COMPOSE_SERVICES = {
    "redis",
    "postgres",
    "migrate",
    "api",
    "scheduler",
    "worker-local",
    "worker-docker",
    "maintenance",
    "beat",
    "flower",
}
ENGINE_SOCKET = "/var/run/docker.sock"


def _mounts(service: Obj) -> set[tuple[str, str]]:
    """(source, target) of each volume, in the short (1.x) or long (v2) syntax."""
    mounts = set()
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        mounts.add((source, target))
    return mounts


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([hms])", duration))


def test_docker_compose_file_is_valid_and_runs_every_process() -> None:
    compose = shutil.which("docker-compose")
    require(compose is not None, "Debian's docker-compose (apt-get install docker-compose)")
    assert compose is not None
    done = subprocess.run(
        [compose, "-f", "docker-compose.yml", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    services: dict[str, Obj] = yaml.safe_load(done.stdout)["services"]
    assert set(services) >= COMPOSE_SERVICES

    assert (ENGINE_SOCKET, ENGINE_SOCKET) in _mounts(services["worker-docker"])
    assert services["worker-docker"]["command"][:3] == ["worker", "--provider", "docker"]
    assert services["worker-local"]["command"][:3] == ["worker", "--provider", "local"]
    for name in ("worker-local", "worker-docker"):
        assert _seconds(services[name]["stop_grace_period"]) >= 900, name
    assert services["migrate"]["command"] == ["db", "upgrade"]
    published = {
        name: [str(port.get("target") if isinstance(port, dict) else port) for port in ports]
        for name, ports in ((n, s.get("ports", [])) for n, s in services.items())
    }
    assert any("8300" in port for port in published["api"])
    assert any("5555" in port for port in published["flower"])
    for name in ("redis", "postgres", "api"):
        assert "healthcheck" in services[name], name
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])

    corral = COMPOSE_SERVICES - {"redis", "postgres"}
    for name in corral:
        service = services[name]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile", name
        if name != "migrate":
            depends = service["depends_on"]
            assert depends["migrate"]["condition"] == "service_completed_successfully", name
            assert depends["redis"]["condition"] == "service_healthy", name
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"

    # The compose deployment's provider configuration is one the providers accept.
    from corral.providers.registry import get_provider_class

    config = json.loads(services["api"]["environment"]["CORRAL_PROVIDER_CONFIG"])
    for provider, values in config.items():
        get_provider_class(provider).config_model.model_validate(values)


# -- the Makefile --------------------------------------------------------------------------


def test_makefile_has_the_documented_targets() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", makefile, re.MULTILINE))
    assert {"run", "test", "lint", "typecheck", "up", "down", "sandbox-image", "bench"} <= targets
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.MULTILINE)
    assert phony is not None and {"up", "down"} <= set(phony.group(1).split())
    up = re.search(r"^up:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert up is not None and "up --build -d" in up.group(1)
