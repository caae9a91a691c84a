"""The docker provider's configuration and options (no SDK needed)."""

from __future__ import annotations

from pydantic import Field, field_validator

from corral.providers.config import ProviderConfig, ProviderOptions

# Where the deployment's tool cache is mounted in every sandbox.
TOOL_CACHE_MOUNT = "/opt/corral/tool-cache"


class DockerProviderConfig(ProviderConfig):
    """Configuration of the docker provider for one engine."""

    base_url: str | None = Field(
        default=None,
        description="Engine address, e.g. unix:///var/run/docker.sock; "
        "default: DOCKER_HOST or the local socket.",
    )
    image: str = Field(default="corral-sandbox:dev", description="image when the spec has none")
    network: str = Field(
        default="bridge",
        description="network mode for sandboxes that may use the network (host, bridge or a "
        "named network); sandboxes without network always get none",
    )
    deployment: str = Field(
        default="default", description="label value that tells this deployment's sandboxes apart"
    )
    max_concurrent: int | None = Field(default=None, gt=0, description="live containers at most")
    default_timeout_s: int = Field(default=3600, gt=0)
    grace_period_s: int = Field(default=10, ge=0, description="stop: TERM to KILL")
    read_only_root: bool = Field(
        default=False, description="read-only root filesystem; /work and /tmp stay writable"
    )
    pids_limit: int = Field(
        default=1024, gt=0, description="processes (and threads) per container at most"
    )
    max_log_mb: int | None = Field(
        default=64,
        gt=0,
        description="what the engine keeps of a container's output on its host's disk, in "
        "MiB (json-file, rotated in two files of half each); null: the engine's own log "
        "driver and options, as its daemon.json sets them",
    )
    user: str | None = Field(
        default=None, description="run as this user (not root) instead of the image's"
    )
    sandbox_user: str = Field(
        default="10001:10001",
        description="the user a container runs as when its image's user is root or unset: "
        "sandboxes never run as root",
    )
    runtime: str | None = Field(
        default=None,
        min_length=1,
        description="OCI runtime of the containers, e.g. runsc (gVisor); the engine must have "
        "it registered. Default: the engine's default runtime",
    )
    tool_cache_dir: str | None = Field(
        default=None,
        min_length=1,
        description="a directory on the engine's host mounted read-only at "
        f"{TOOL_CACHE_MOUNT} in every sandbox (CORRAL_TOOL_CACHE): where kits are found "
        "offline (docs/dispatch.md#kits)",
    )

    @field_validator("user", "sandbox_user")
    @classmethod
    def _not_root(cls, value: str | None) -> str | None:
        if value is not None and is_root_user(value):
            raise ValueError("sandboxes never run as root: give an unprivileged user")
        return value


def is_root_user(user: str) -> bool:
    """Whether a container ``user`` (``name``, ``uid`` or either with ``:group``) is root, or
    unset, which the engine takes for root."""
    return user.partition(":")[0].strip() in ("", "0", "root")


class DockerProviderOptions(ProviderOptions):
    """Per-sandbox options of the docker provider (a pool's ``sandbox_config``)."""

    command: tuple[str, ...] | None = Field(
        default=None, min_length=1, description="run this argv instead of the image entrypoint"
    )
    image: str | None = Field(
        default=None, min_length=1, description="the pool's image, instead of the configured one"
    )
