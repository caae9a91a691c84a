"""The modal provider's configuration and options (no SDK needed)."""

from __future__ import annotations

from pydantic import Field

from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.pacing import IN_FLIGHT_SOURCE, creates_in_flight_field


class ModalProviderConfig(ProviderConfig):
    """Deployment-wide configuration of the modal provider."""

    server_url: str | None = Field(
        default=None,
        description="Modal API URL; default: the SDK's (MODAL_SERVER_URL, ~/.modal.toml, "
        "else api.modal.com)",
    )
    environment: str | None = Field(
        default=None, description="Modal environment; default: the SDK's (MODAL_ENVIRONMENT)"
    )
    app_name: str = Field(default="corral", min_length=1, description="app the sandboxes run in")
    image: str = Field(
        default="corral-sandbox:latest",
        min_length=1,
        description="registry image reference, or an im-… Modal image id; must hold the runner",
    )
    command: tuple[str, ...] = Field(
        default=("python3", "-m", "runner"), min_length=1, description="runner argv"
    )
    workdir: str | None = Field(default=None, description="absolute working directory")
    gpu_type: str = Field(
        default="any", min_length=1, description="GPU type for work that asks for GPUs (T4, A100…)"
    )
    default_timeout_s: int = Field(
        default=3600, gt=0, description="sandbox lifetime when the work asks for none"
    )
    request_timeout_s: float = Field(default=30.0, gt=0, description="per call but create")
    create_timeout_s: float = Field(
        default=600.0, gt=0, description="image, scheduling and start of one sandbox"
    )
    deployment: str = Field(
        default="default", description="tag value that marks this deployment's sandboxes"
    )
    # Modal documents no sandbox creation rate: no rate unless the deployment sets one.
    creates_in_flight: int | None = creates_in_flight_field(20, IN_FLIGHT_SOURCE)


class ModalProviderOptions(ProviderOptions):
    image: str | None = Field(default=None, description="an image other than the default")
    gpu_type: str | None = Field(default=None, description="a GPU type other than the default")
    command: tuple[str, ...] | None = Field(default=None, min_length=1, description="argv")
