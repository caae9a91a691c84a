"""The daytona provider's configuration and options (no SDK needed)."""

from __future__ import annotations

from pydantic import Field, model_validator

from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.pacing import (
    DOCUMENTED_SHARE,
    IN_FLIGHT_SOURCE,
    create_burst_field,
    creates_in_flight_field,
    creates_per_s_field,
)


class DaytonaProviderConfig(ProviderConfig):
    """Deployment-wide configuration of the daytona provider."""

    api_url: str = Field(default="https://app.daytona.io/api", description="the Daytona API")
    target: str | None = Field(default=None, description="region; default: the organization's")
    snapshot: str | None = Field(
        default="corral-runner",
        description="snapshot sandboxes are made from (None: Daytona's default); it must have "
        "corral's runner",
    )
    image: str | None = Field(
        default=None, min_length=1, description="an image to build sandboxes from instead"
    )
    command: tuple[str, ...] = Field(
        default=("python3", "-m", "runner"),
        min_length=1,
        description="argv of the runner, started detached in each new sandbox",
    )
    default_timeout_s: int = Field(
        default=3600, gt=0, description="the auto-stop interval when the work asks for no timeout"
    )
    auto_delete_minutes: int = Field(
        default=0, ge=-1, description="delete a sandbox this long after it stops; -1: never"
    )
    disk_gb: int | None = Field(default=None, gt=0, description="disk of image-based sandboxes")
    create_timeout_s: float = Field(default=120, gt=0, description="creating and starting one")
    request_timeout_s: float = Field(default=30, gt=0, description="every other call")
    deployment: str = Field(
        default="default", description="label value that marks this deployment's sandboxes"
    )
    creates_per_s: float | None = creates_per_s_field(
        DOCUMENTED_SHARE * 600 / 60,
        "0.9 of Daytona's 600 sandbox creations a minute (daytona.io/docs/en/rate-limits)",
    )
    create_burst: int = create_burst_field(10, "10, a second's worth of its rate")
    creates_in_flight: int | None = creates_in_flight_field(20, IN_FLIGHT_SOURCE)


class DaytonaProviderOptions(ProviderOptions):
    """Per-sandbox options of the daytona provider: another source or runner command."""

    snapshot: str | None = Field(default=None, min_length=1, description="another snapshot")
    image: str | None = Field(default=None, min_length=1, description="an image instead")
    command: tuple[str, ...] | None = Field(default=None, min_length=1, description="argv")
    disk_gb: int | None = Field(default=None, gt=0, description="disk of an image-based one")

    @model_validator(mode="after")
    def _one_source(self) -> DaytonaProviderOptions:
        if self.snapshot and self.image:
            raise ValueError("give snapshot or image, not both")
        return self
