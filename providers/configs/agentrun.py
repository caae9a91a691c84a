"""The agentrun provider's configuration (no SDK needed; it takes no per-sandbox options)."""

from __future__ import annotations

from pydantic import Field

from corral.providers.config import ProviderConfig
from corral.providers.descriptors import AGENTRUN_HARD_TIMEOUT_S


class AgentRunConfig(ProviderConfig):
    """Deployment-wide configuration of the agentrun provider."""

    template_name: str = Field(
        default="corral-code-interpreter",
        min_length=1,
        description="the code-interpreter template sandboxes are made from (create it once "
        "in the AgentRun console or with the SDK)",
    )
    region: str | None = Field(default=None, description="default: AGENTRUN_REGION, cn-hangzhou")
    account_id: str | None = Field(
        default=None, description="Aliyun primary account id; default: AGENTRUN_ACCOUNT_ID"
    )
    data_endpoint: str | None = Field(
        default=None,
        description="the data API's URL; default: AGENTRUN_DATA_ENDPOINT, else "
        "https://<account>.agentrun-data.<region>.aliyuncs.com",
    )
    max_timeout_s: float = Field(
        default=AGENTRUN_HARD_TIMEOUT_S,
        gt=0,
        le=AGENTRUN_HARD_TIMEOUT_S,
        description="the longest an execute call may take (AgentRun's hard limit is 30 s)",
    )
    execute_grace_s: float = Field(
        default=15.0, gt=0, le=120, description="client-side wait past the limit for an answer"
    )
    ready_timeout_s: float = Field(
        default=60.0, gt=0, description="how long a new sandbox may take to report healthy"
    )
    idle_timeout_s: int = Field(
        default=60,
        gt=0,
        description="sandboxIdleTimeoutSeconds: AgentRun removes a sandbox idle this long "
        "(bounds what a crashed worker leaves behind)",
    )
