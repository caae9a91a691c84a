"""What the api answers: one model per success answer, for the admin api and the runner
protocol, so that ``/openapi.json`` documents each and FastAPI checks each before sending.

The views of :mod:`corral.scheduler.admin.views` and :mod:`corral.scheduler.admin.pools`
are dicts (the CLI prints them too); the routes validate them into these models. Times are
ISO 8601 with their UTC offset (``+00:00``), as ``datetime.isoformat`` writes them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema

from corral.providers.base import SandboxState
from corral.providers.capabilities import BillingModel
from corral.shared.messages import GitInput, Work
from corral.shared.store.kinds import AuthMode, BundleReview, CostGrouping, ItemState
from corral.shared.store.profiles import Profile


def _iso(value: datetime) -> str:
    return value.isoformat()


Timestamp = Annotated[
    AwareDatetime,
    PlainSerializer(_iso, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
LogStream = Literal["stdout", "stderr", "system"]
Count = Annotated[int, Field(ge=0)]


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Health(Answer):
    status: Literal["ok"]


class Dispatched(Answer):
    """202 for a new item; 200, ``created: false``, for the item an earlier dispatch with
    the same idempotency key made."""

    id: str
    created: bool
    state: ItemState = Field(description="the item's state once the dispatch was written")
    error: ItemError | None = Field(
        description="a dispatch error's code and message (state dispatch_error); else null"
    )


# -- work items ----------------------------------------------------------------------------


class ItemError(Answer):
    code: str = Field(description="e.g. unknown_profile, work_failed, deadline")
    message: str | None


class ItemSandbox(Answer):
    """The sandbox of the item's current attempt."""

    id: str
    provider_id: str
    external_id: str | None
    status: SandboxState
    termination_reason: str | None
    end_log: str | None = Field(
        description="when it ended before its runner reported (never claimed, lost, killed): "
        "the last lines of its provider's own log of it (its entrypoint's output, the "
        "container's or the pod's log), at most 40 lines and 4 KiB, control characters "
        "removed and the item's env values redacted; null otherwise, or when the provider "
        "keeps no such log (docs/dispatch.md#why-a-sandbox-ended)"
    )


class ItemTimestamps(Answer):
    created_at: Timestamp
    routed_at: Timestamp | None
    provisioned_at: Timestamp | None
    claimed_at: Timestamp | None
    finished_at: Timestamp | None
    not_before: Timestamp | None = Field(
        description="a requeued item is not routed again before this (its lease's back-off)",
    )
    expires_at: Timestamp | None = Field(
        description="its message's own expiry: not final by then, it fails as expired",
    )


class ItemLease(Answer):
    max_attempts: int
    retry_on_work_failed: bool
    on_heartbeat_lost: Literal["fail", "requeue"]
    backoff_s: float
    backoff_factor: float
    backoff_max_s: float


class ItemLogCounts(Answer):
    lines: Count
    bytes: Count
    dropped_lines: Count = Field(description="lines dropped past the item's log budget")


class BundleView(Answer):
    """A work item's result bundle: what it holds, where it is kept, its review."""

    review: BundleReview
    changes: Count = Field(description="paths added, modified or deleted")
    refused: Count = Field(description="paths left out (e.g. a symlink out of the workspace)")
    content_bytes: Count = Field(description="its members' bytes, uncompressed")
    size_bytes: Count = Field(description="the archive's bytes")
    sha256: str
    store: str = Field(description="database, filesystem or s3")
    reviewed_by: str | None
    reviewed_at: Timestamp | None
    created_at: Timestamp | None


class BundleStored(Answer):
    review: BundleReview


class BundleReviewed(Answer):
    id: str
    review: BundleReview


class WorkItemRow(Answer):
    id: str
    org: str
    project: str
    idempotency_key: str | None
    task_id: str | None = Field(
        description="the Celery task id of the corral.dispatch message that made it"
    )
    state: ItemState
    pool: str | None = Field(description="its pool's name, once routed")
    queue: str | None
    error_code: str | None
    exit_code: int | None
    created_at: Timestamp
    finished_at: Timestamp | None


class WorkItemList(Answer):
    items: list[WorkItemRow] = Field(description="newest first")
    next_cursor: str | None = Field(
        description="pass as `cursor` for the next page; null: this is the last"
    )


class ItemWaiting(Answer):
    """What holds a waiting item, and its place (docs/architecture.md §4, admission order)."""

    reason: Literal[
        "pool_full", "breaker_open", "org_limit", "provider_pace", "provider_in_flight"
    ] = Field(
        description="pool_full: every pool it qualifies for is full; breaker_open: some are "
        "passed by for their circuit breaker; org_limit: its org is at its limit across pools; "
        "provider_pace: routed (its slot held), its create waits for its provider's pace; "
        "provider_in_flight: routed, its provider's creates in flight are at their cap"
    )
    pools: list[str] = Field(description="the names of the pools it waits for")
    priority: Literal["low", "normal", "high"]
    ahead: Count = Field(
        description="its org's waiting items before it in admission order (at most 10,000); "
        "held by its provider's pace: its pool's paced items that go before it"
    )
    until: Timestamp | None = Field(
        default=None,
        description="held by its provider's pace: when its create may go (an estimate)",
    )
    estimated_start_at: Timestamp | None = Field(
        description="when it may start: those ahead and its own turn at the rate its pools "
        "handed slots on in the last 10 minutes (held by its provider's pace: its pool's "
        "creates); null: nothing handed on lately, unknown"
    )
    estimated_wait_s: float | None = Field(
        ge=0, description="seconds from now to estimated_start_at; null: unknown"
    )
    estimate: Literal["about", "at_least"] | None = Field(
        description="about: an estimate; at_least: a lower bound, its place counted only up "
        "to 10,000 ahead; null: unknown"
    )


class WorkItemView(Answer):
    id: str
    org: str
    project: str
    profile: str | None
    state: ItemState
    pool_id: str | None
    pool: str | None = Field(description="the pool's name")
    queue: str | None
    attempts: Count
    lease: ItemLease = Field(
        description="the lease policy in force: chosen by the message, else its pool, else "
        "the deployment's defaults (docs/dispatch.md#lease)"
    )
    exit_code: int | None
    result: Any = Field(description="the work's JSON result (code work), or null")
    duration_s: float | None
    error: ItemError | None
    sandbox: ItemSandbox | None
    timestamps: ItemTimestamps
    logs: ItemLogCounts
    bundle: BundleView | None = Field(description="its result bundle, once uploaded")
    waiting: ItemWaiting | None = Field(
        description="while it waits for capacity: what holds it and its place"
    )


class LogLineView(Answer):
    id: int = Field(description="pass the last one as ?after= to read on")
    stream: LogStream
    line: str


class WorkItemLogs(Answer):
    lines: list[LogLineView]
    dropped_lines: Count


class _Event(Answer):
    entity_id: str
    actor: str
    detail: str | None
    at: Timestamp


class ItemEvent(_Event):
    entity: Literal["work_item"]
    from_: ItemState | None = Field(alias="from")
    to: ItemState


class SandboxEvent(_Event):
    entity: Literal["sandbox"]
    from_: SandboxState | None = Field(alias="from")
    to: SandboxState


class BundleEvent(_Event):
    """A result bundle stored (from null) or reviewed; entity_id is the work item's id."""

    entity: Literal["bundle"]
    from_: BundleReview | None = Field(alias="from")
    to: BundleReview


LifecycleEventView = Annotated[
    ItemEvent | SandboxEvent | BundleEvent, Field(discriminator="entity")
]


class WorkItemEvents(Answer):
    events: list[LifecycleEventView]


class SecretUseView(Answer):
    """One read of a named secret for the item: which one and where it went, never its
    value."""

    name: str
    scope: Literal["org", "deployment"]
    used_in: str = Field(description="env (secret_env, at the claim) or binding (at provision)")
    target: str = Field(description="the env variable or secret binding it went to")
    at: Timestamp


class WorkItemSecretUses(Answer):
    uses: list[SecretUseView]


class Cancelled(Answer):
    """The item's state: cancelled, or the final state it had already reached."""

    id: str
    state: ItemState


# -- admin ---------------------------------------------------------------------------------


class SecretRow(Answer):
    """A named secret: never its value."""

    name: str
    scope: Literal["org", "deployment"]
    org: str | None
    created_at: Timestamp
    updated_at: Timestamp


class SecretList(Answer):
    org: str | None = Field(description="null: the deployment's secrets")
    secrets: list[SecretRow]


class SecretStored(Answer):
    name: str
    scope: Literal["org", "deployment"]
    org: str | None
    created: bool = Field(description="false: an existing secret's value was replaced")


class ProfileRow(Answer):
    name: str
    model: str
    auth_mode: AuthMode


class ProfileList(Answer):
    profiles: list[ProfileRow]


class BreakerView(Answer):
    state: Literal["closed", "open", "half_open"]
    failures: Count = Field(description="provision failures in a row, counted toward opening")
    opened_at: str | None = Field(description="when it last opened (ISO 8601), null if closed")


class PoolRow(Answer):
    id: str
    org_id: str
    name: str
    provider_id: str
    priority: int
    active: bool
    max_concurrent: int
    max_concurrent_ceiling: int = Field(
        description="the most max_concurrent an org key may set (the deployment sets it)"
    )
    runtime_provides: dict[str, Any] | None
    capabilities: dict[str, Any] | None
    sandbox_config: dict[str, Any]
    billing_model: BillingModel | None = Field(description="null: the provider's")
    rate_micros: Count
    warm_min: Count = Field(description="warm sandboxes kept ready (docs/warm-pools.md)")
    warm_idle_ttl_s: Count = Field(description="how long a warm sandbox may wait unbound")
    warm_schedule: list[dict[str, Any]] | None = Field(
        description="windows of the week (UTC) with a warm_min of their own"
    )
    routed_ttl_s: Count | None = Field(
        description="seconds an item may stay routed to its queue while no worker consumes "
        "it before it fails as no_worker (0: for ever); null: CORRAL_ROUTED_TTL_S",
    )
    slots_in_use: Count = Field(description="slots its items hold now")
    capacity_id: str | None = Field(
        description="the shared capacity it draws on (docs/architecture.md §4); null: none"
    )
    capacity: str | None = Field(description="that capacity's name; null: none")
    share_limit: Count | None = Field(
        description="its share of that capacity now: the most slots it may hold (set by the "
        "fair division); null: not on a shared capacity"
    )
    breaker: BreakerView = Field(description="its circuit breaker (docs/operations.md)")
    lease: dict[str, Any] | None = Field(
        description="its default lease policy: the fields it sets for its items "
        "(docs/operations.md#lease-policies)",
    )


class PoolList(Answer):
    pools: list[PoolRow]


class SandboxRow(Answer):
    id: str
    work_item_id: str
    attempt: int
    org_id: str
    pool_id: str
    provider_id: str
    external_id: str | None
    status: SandboxState
    created_at: Timestamp
    started_at: Timestamp | None
    deadline_at: Timestamp | None
    last_heartbeat_at: Timestamp | None
    terminated_at: Timestamp | None
    termination_reason: str | None


class SandboxList(Answer):
    sandboxes: list[SandboxRow]


# -- costs ---------------------------------------------------------------------------------


class CostTotal(Answer):
    events: Count
    seconds: float
    amount_micros: int
    amount: str = Field(description="amount_micros as a decimal of the currency unit")


class _CostRow(CostTotal):
    cpu_estimated_events: Count = Field(
        description="active-cpu events billed by wall-clock (no usage reported)"
    )


class PoolCosts(_CostRow):
    pool: str


class ProviderCosts(_CostRow):
    provider: str


class ProjectCosts(_CostRow):
    project: str


class OrgCosts(_CostRow):
    org: str


class CostView(Answer):
    """Each row is named by the grouping: a ``pool``, ``provider``, ``project`` or ``org``."""

    by: CostGrouping
    org: str | None
    since: Timestamp | None
    rows: list[PoolCosts] | list[ProviderCosts] | list[ProjectCosts] | list[OrgCosts]
    total: CostTotal


# -- the runner protocol -------------------------------------------------------------------


class Registered(Answer):
    session_token: str = Field(description="crs_...: the bearer of every later call")
    sandbox_id: str
    work_item_id: str
    heartbeat_interval_s: float = Field(gt=0)
    claim: Claimed | None = Field(
        description="the claimed work item, when the registration asked to claim it and it "
        "could be claimed now; null: call /claim",
    )


class Enrolled(Answer):
    channel_token: str = Field(description="crw_...: the bearer of the warm wait calls")
    sandbox_id: str = Field(description="the warm sandbox's id")
    wait_s: float = Field(gt=0, description="how long the api holds one wait call at most")


class WarmWaitAnswer(Answer):
    registration_token: str | None = Field(
        description="crt_...: the bound item's one-time registration token, sent once; null: "
        "not bound yet, call again"
    )


class ClaimBundle(Answer):
    """The limits of the result bundle the runner is to collect."""

    max_bytes: int = Field(gt=0, description="its members' bytes, uncompressed")
    max_manifest_bytes: int = Field(gt=0)
    max_patches: int = Field(gt=0)


class ClaimGit(Answer):
    """The git input as the runner gets it. A model of its own: the dispatch body's
    ``GitInput`` keeps its defaults in the schema (an answer's fields are always sent)."""

    url: str
    ref: str
    secret: str | None = Field(
        description="the named secret the checkout uses (its value never reaches the sandbox)"
    )

    @classmethod
    def of(cls, git: GitInput) -> ClaimGit:
        return cls(url=git.url, ref=git.ref, secret=git.secret)


class ClaimInputs(Answer):
    git: ClaimGit | None


class ClaimProfile(Answer):
    """The item's model profile, which its work also finds in CORRAL_MODEL, CORRAL_PROFILE
    and CORRAL_AUTH_MODE (docs/dispatch.md#model-profiles)."""

    name: str
    model: str = Field(description="the model the work is to use")
    auth_mode: AuthMode

    @classmethod
    def of(cls, profile: Profile) -> ClaimProfile:
        return cls(name=profile.name, model=profile.model, auth_mode=AuthMode(profile.auth_mode))


class Claimed(Answer):
    work_item_id: str
    work: Work
    install_commands: list[str]
    post_acquire: list[str]
    pre_release: list[str]
    env: dict[str, str]
    path: list[str] = Field(
        description="directories the runner puts in front of PATH for every step and the "
        "work (the kits' tool-cache directories); $VAR and ${VAR} are expanded from the "
        "sandbox's environment",
    )
    timeout_s: int | None = Field(gt=0)
    max_result_bytes: int = Field(
        gt=0,
        description="the largest result (as JSON) the item may return; past it the "
        "item fails result_too_large",
    )
    bundle: ClaimBundle | None = Field(
        description="collect the workspace's changes as a result bundle within these limits "
        "(PUT /v1/runner/bundle before complete); null: do not"
    )
    inputs: ClaimInputs | None = Field(
        description="what to put into the workspace between install and post_acquire"
    )
    profile: ClaimProfile | None = Field(
        description="the model profile the item names (its own, else `default`); null: none "
        "exists any more"
    )


class HeartbeatAnswer(Answer):
    cancel: bool = Field(description="true: stop the work, the item ended from outside")


class LogsAccepted(Answer):
    accepted: Count
    dropped: Count = Field(description="lines past the item's log budget; send no more")


class Completed(Answer):
    state: ItemState = Field(
        description="the item's final state; received when its lease policy routes it again "
        "(retry_on_work_failed: a new sandbox runs it)"
    )


class ProviderRow(Answer):
    id: str
    display_name: str | None
    source: Literal["registered", "builtin", "entry-point"]
    sdk_installed: bool
    capabilities: dict[str, Any] | None = Field(description="its default capability matrix")
    problem: str | None = Field(description="why it cannot be used here, e.g. its SDK is missing")


class ProviderList(Answer):
    providers: list[ProviderRow]


class ProviderSchema(Answer):
    provider: str
    display_name: str
    config: dict[str, Any] = Field(description="JSON schema of the deployment's configuration")
    options: dict[str, Any] = Field(description="JSON schema of a pool's sandbox_config")


class ProviderConfigView(Answer):
    provider: str
    source: Literal["stored", "environment", "default"] = Field(
        description="stored (admin api, CLI), environment (CORRAL_PROVIDER_CONFIG) or default"
    )
    config: dict[str, Any] = Field(description="secrets masked")
    updated_at: Timestamp | None


class ProviderCheck(Answer):
    provider: str
    org: str | None
    healthy: bool
    message: str


class CredentialRow(Answer):
    provider: str
    updated_at: Timestamp


class CredentialList(Answer):
    org: str
    credentials: list[CredentialRow] = Field(description="names only, never a secret")


class CredentialStored(Answer):
    org: str
    provider: str


class Deleted(Answer):
    id: str
    deleted: Literal[True]


class BudgetRow(Answer):
    id: str
    org_id: str
    pool_id: str | None = Field(description="null: the org's budget")
    pool: str | None = Field(description="the pool's name")
    period: Literal["day", "week", "month"]
    set_by: Literal["deployment", "org"] = Field(
        description="who set it: the deployment's budgets an org key may not change"
    )
    on_cap: Literal["refuse", "stop"] = Field(
        description="at the cap: refuse new work, or also stop the running sandboxes"
    )
    thresholds: list[int] = Field(description="percentages of the cap warned of once a period")
    since: str = Field(description="when the current period began (UTC, ISO 8601)")
    cap_micros: Count
    spent_micros: Count = Field(description="billed plus run up by sandboxes not billed yet")
    billed_micros: Count
    running_micros: Count
    exhausted: bool = Field(description="routing refuses the org's (or the pool's) new work")
    warned_pct: int | None = Field(description="the highest threshold warned of this period")


class BudgetList(Answer):
    budgets: list[BudgetRow]


class ApiKeyRow(Answer):
    id: str
    org_id: str
    name: str
    scopes: list[Literal["dispatch", "read", "review", "admin"]]
    created_at: Timestamp
    revoked_at: Timestamp | None = Field(description="null while the key works")


class ApiKeyCreated(ApiKeyRow):
    key: str = Field(description="the key itself (cok_...): shown this once, never again")


class ApiKeyList(Answer):
    keys: list[ApiKeyRow]


class OrgPolicyView(Answer):
    org_id: str
    item_images: list[str] | None = Field(
        description="image patterns the org's items may name; null: CORRAL_ITEM_IMAGES"
    )
    regions: list[str] | None = Field(
        description="region patterns the org's items may ask for; null: any"
    )


class PoolFieldOwners(Answer):
    owners: dict[str, str] = Field(
        description="each pool field, and who may change it: org (an org admin key, "
        "max_concurrent up to the pool's ceiling) or deployment (the admin token alone)"
    )


class OrgLimitView(Answer):
    org_id: str
    max_concurrent: Count | None = Field(description="null: no limit across the org's pools")
    in_flight: Count = Field(description="slots the org's pools hold now")
