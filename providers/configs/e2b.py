"""The e2b provider's configuration and options (no SDK needed)."""

from __future__ import annotations

from pydantic import Field

from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.pacing import (
    DOCUMENTED_SHARE,
    IN_FLIGHT_SOURCE,
    creates_in_flight_field,
    creates_per_s_field,
)


class E2BProviderConfig(ProviderConfig):
    """Deployment-wide configuration of the e2b provider."""

    template: str = Field(
        default="corral-runner", description="template (name or id) sandboxes are made from"
    )
    runner_command: str = Field(
        default="python3 -m runner",
        description="started in the background in each new sandbox; the template must have it",
    )
    domain: str | None = Field(default=None, description="E2B domain (default e2b.app)")
    api_url: str | None = Field(default=None, description="E2B API URL, for self-hosted E2B")
    sandbox_url: str | None = Field(
        default=None, description="sandbox (envd) URL, for self-hosted E2B"
    )
    request_timeout_s: float = Field(default=30.0, gt=0)
    default_timeout_s: int = Field(
        default=3600, gt=0, description="sandbox lifetime when the work asks for none"
    )
    deployment: str = Field(
        default="default", description="label value that marks this deployment's sandboxes"
    )
    creates_per_s: float | None = creates_per_s_field(
        DOCUMENTED_SHARE * 5,
        "0.9 of E2B Pro's 5 creates a second (Hobby: 1; e2b.dev/docs/sandbox/rate-limits)",
    )
    creates_in_flight: int | None = creates_in_flight_field(20, IN_FLIGHT_SOURCE)


class E2BProviderOptions(ProviderOptions):
    template: str | None = Field(default=None, description="a template other than the default")
