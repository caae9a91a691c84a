"""The vercel provider's configuration and options (no SDK needed)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.descriptors import BUILTIN

# Vercel's longest session, from the capability matrix.
MAX_SESSION_S = BUILTIN["vercel"].capabilities.max_session_duration_seconds or 18_000


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GitSourceConfig(_Source):
    type: Literal["git"]
    url: str
    revision: str | None = None
    depth: int | None = Field(default=None, gt=0)
    username: str | None = None
    password: SecretStr | None = None


class TarballSourceConfig(_Source):
    type: Literal["tarball"]
    url: str


class SnapshotSourceConfig(_Source):
    type: Literal["snapshot"]
    snapshot_id: str


SourceConfig = Annotated[
    GitSourceConfig | TarballSourceConfig | SnapshotSourceConfig, Field(discriminator="type")
]


class VercelProviderConfig(ProviderConfig):
    """Deployment-wide configuration of the vercel provider."""

    team_id: str | None = Field(default=None, description="Vercel team id (required)")
    project_id: str | None = Field(
        default=None, description="Vercel project id the sandboxes belong to (required)"
    )
    api_url: str | None = Field(
        default=None, description="Sandbox API base URL (default: the SDK's, Vercel's own)"
    )
    image: str | None = Field(
        default=None,
        description="Vercel Container Registry image sandboxes boot (default: Vercel's "
        "universal image); it must have the runner",
    )
    source: SourceConfig | None = Field(
        default=None, description="git, tarball or snapshot the sandbox's files come from"
    )
    runner_command: str = Field(
        default="python3 -m runner",
        description="started detached in each new sandbox; the image must have it",
    )
    region: str | None = Field(default=None, description="region sandboxes are made in")
    vcpus: int | None = Field(
        default=None, gt=0, description="vCPUs when the work asks for none (Vercel's default)"
    )
    default_timeout_s: int = Field(
        default=3600,
        gt=0,
        le=MAX_SESSION_S,
        description="sandbox lifetime when the work asks for none",
    )
    request_timeout_s: float = Field(default=30.0, gt=0)
    deployment: str = Field(
        default="default", description="tag value that marks this deployment's sandboxes"
    )


class VercelProviderOptions(ProviderOptions):
    image: str | None = Field(default=None, description="an image other than the default")
    source: SourceConfig | None = Field(default=None, description="a source other than the default")
    command: list[str] | None = Field(
        default=None, min_length=1, description="argv started detached instead of the runner"
    )
