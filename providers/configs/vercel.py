"""The vercel provider's configuration and options (no SDK needed)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.descriptors import BUILTIN
from corral.providers.pacing import (
    DOCUMENTED_SHARE,
    IN_FLIGHT_SOURCE,
    create_burst_field,
    creates_in_flight_field,
    creates_per_s_field,
)

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
    creates_per_s: float | None = creates_per_s_field(
        DOCUMENTED_SHARE * 200 / 60 / 2,
        "0.9 of Vercel Pro's 200 vCPUs allocated a minute at its default of 2 vCPUs a sandbox "
        "(Hobby: 40 vCPUs in 10 minutes; vercel.com/docs/vercel-sandbox/pricing)",
    )
    create_burst: int = create_burst_field(10, "10")
    creates_in_flight: int | None = creates_in_flight_field(20, IN_FLIGHT_SOURCE)


class VercelProviderOptions(ProviderOptions):
    image: str | None = Field(default=None, description="an image other than the default")
    source: SourceConfig | None = Field(default=None, description="a source other than the default")
    command: list[str] | None = Field(
        default=None, min_length=1, description="argv started detached instead of the runner"
    )
