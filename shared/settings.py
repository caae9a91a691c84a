"""Process-wide settings, read from ``CORRAL_*`` environment variables.

Precedence everywhere: an explicit argument beats a setting, and a setting beats the
default declared here.

The settings are declared in one class per component (:data:`COMPONENTS`), each field in
exactly one of them: :class:`CommonSettings` holds what every process needs, and a
component's class inherits the common one and any other whose fields it reads. A function
takes the narrowest class it needs, so the type checker proves it reads no other
component's settings. :class:`CoreSettings` combines them all: a process builds that one
object (its runtime holds it) and hands it, or a part of it, to whatever it calls. The
environment variables are the fields' names, upper-cased, after ``CORRAL_``, whichever
class declares them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from corral.providers.config import default_state_dir
from corral.providers.egress.rules import parse_host_rules
from corral.shared.broker.envelope import MAX_DEPTH, Limits

KIB = 1024
MIB = 1024 * KIB


def split_list(value: str) -> tuple[str, ...]:
    """The entries of a comma-separated setting, stripped, empty ones dropped."""
    return tuple(entry.strip() for entry in value.split(",") if entry.strip())


def is_redis_url(url: str) -> bool:
    """Whether a broker URL names Redis (TCP, TLS or a Unix socket)."""
    return url.startswith(("redis://", "rediss://", "unix://", "redis+socket://"))


def host_rules_setting(value: str, variable: str) -> str:
    """``value``, a setting of comma-separated host rules, once each entry parses.

    Raises:
        ValueError: an entry is not a host rule; the message names ``variable``.
    """
    try:
        parse_host_rules(split_list(value))
    except ValueError as exc:
        raise ValueError(f"{variable}: each entry {exc}") from None
    return value


class CommonSettings(BaseSettings):
    """Settings every process needs: its state, database, broker, messages and logs.

    Also the providers' configuration and egress openings (every process's runtime builds
    providers) and ``max_attempts``, the default lease that the api, the provider workers
    and the reaper all apply.
    """

    # defer_build: a class's validator is built when it is first read, so a process (the
    # CLI's dispatch) builds only CoreSettings' instead of all fourteen as it imports them.
    model_config = SettingsConfigDict(
        env_prefix="CORRAL_", extra="ignore", frozen=True, defer_build=True
    )

    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="Where corral keeps local state (the embedded database, local sandboxes, "
        "the api socket).",
    )
    secret_key: SecretStr | None = Field(
        default=None,
        description="Key that seals stored secrets (provider credentials and configs, "
        "dispatch env values, webhook secrets): at least 32 characters of high entropy, "
        "refused otherwise; generate one with `corral secret-key`.",
    )
    secret_key_previous: SecretStr | None = Field(
        default=None,
        description="Earlier secret keys, comma-separated: values sealed with them still "
        "open until `corral secret-key rotate` seals them again with secret_key; then drop "
        "them.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the system of record; defaults to SQLite in state_dir.",
    )
    db_pool_size: int = Field(
        default=10,
        gt=0,
        le=1000,
        description="PostgreSQL: the most database connections one process opens (its pool, "
        "with no overflow beyond it); a thread that finds none free waits up to "
        "db_pool_timeout_s. A provider worker holds none during provider calls and needs "
        "about two at any concurrency (docs/operations.md: sizing PostgreSQL).",
    )
    db_pool_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="PostgreSQL: how long a thread waits for a free pooled connection before "
        "its work fails (a task then retries, as while the database is down).",
    )
    db_ping_idle_s: float = Field(
        default=1.0,
        ge=0,
        description="PostgreSQL: a pooled connection idle this long or longer is pinged (a "
        "round trip) before use, and replaced if dead; one used more recently is not. A "
        "connection that died within this time fails its next statement, which is retried "
        "as while the database is down. 0: ping before every use.",
    )
    db_auto_upgrade: bool = Field(
        default=False,
        description="Processes apply the schema migrations themselves when they start, "
        "instead of refusing an older schema (`corral db upgrade` does it on purpose).",
    )
    broker_url: str = Field(
        default="memory://",
        description="Celery broker. memory:// only works inside one process (`corral dev`); "
        "use redis://host:6379/0 or amqp://user:password@host:5672/vhost (RabbitMQ) when "
        "processes run apart.",
    )
    broker_start_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a process starting (api, scheduler, workers, beat) waits for "
        "its broker to answer before it exits, non-zero, with one line naming "
        "CORRAL_BROKER_URL; once started, processes wait out a broker's absence.",
    )
    broker_key_prefix: str = Field(
        default="",
        description="Redis only: a prefix for every broker key, so that several deployments "
        "can share one Redis. On RabbitMQ give each deployment a vhost of its own instead "
        "(amqp://host:5672/<vhost>); a prefix there is refused.",
    )
    task_events: bool = Field(
        default=True,
        description="Workers and the scheduler's intake send Celery task events: Flower shows "
        "each task and its state. Off, a provider worker spends about 0.5 ms less CPU per "
        "provision (at hundreds of provisions a second, a fifth of its CPU; "
        "docs/benchmarks.md) and Flower shows no tasks of that process (the scheduler still "
        "sends its heartbeats, so Flower lists it).",
    )
    max_message_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="Largest broker message read, as the transport holds it; larger ones are "
        "dead letters (or invalid_message items).",
    )
    max_message_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="Largest message body after decoding and decompression (a compressed "
        "body is inflated up to this and refused past it).",
    )
    max_message_depth: int = Field(
        default=64, gt=0, le=500, description="Deepest JSON nesting a message body may have."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO",
        description="Process logs: the least level written. DEBUG adds each routine task's "
        "receipt and success (the maintenance worker's and beat's periodic tasks).",
    )
    log_format: Literal["json", "text"] = Field(
        default="json",
        description="Process logs: JSON lines (with work item, sandbox and org ids) or text. "
        "Either way, token- and credential-shaped text is redacted before it is written.",
    )
    metrics_org_labels: bool = Field(
        default=False,
        description="Label the items' outcome counters (corral_items_finished_total, "
        "corral_dispatch_errors_total) with the item's org: one series per org, affordable "
        "for tens of orgs; off, the label is empty.",
    )
    provider_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Per-provider configuration as JSON, e.g. {"local": {"max_concurrent": 8}}. '
        "A configuration stored in the database (`corral providers config set`, the admin "
        "api) replaces a provider's entry here.",
    )
    provider_config_refresh_s: float = Field(
        default=10.0,
        ge=0,
        description="How often a process reads the stored provider configuration again; a "
        "changed one is used from the next provision on, without a restart.",
    )
    egress_open_networks: str = Field(
        default="",
        description="worker: destinations corral's egress proxy may reach although they are "
        "closed to every sandbox (loopback, private, shared, link-local and the like): "
        "comma-separated host rules, e.g. 10.1.2.0/24:443,127.0.0.1:8080. The deployment's "
        "alone: no message or org key can open an address.",
    )
    max_attempts: int = Field(
        default=3,
        gt=0,
        description="Sandboxes one work item may get: work whose sandbox died before the claim "
        "is routed again until then, and fails with the reason after.",
    )

    egress_upstream_ca_file: Path | None = Field(
        default=None,
        description="worker: a PEM file of CA certificates corral's egress proxy trusts beside "
        "the system's store when it checks the certificate of a secret binding's host (it "
        "terminates that host's TLS to put the value in): a deployment's own CA for internal "
        "services. The deployment's alone: no message or org key can add a CA.",
    )

    @field_validator("egress_open_networks")
    @classmethod
    def _open_networks(cls, value: str) -> str:
        return host_rules_setting(value, "CORRAL_EGRESS_OPEN_NETWORKS")

    @model_validator(mode="after")
    def _prefix_on_redis_only(self) -> Self:
        # kombu's AMQP transport has no key prefix: accepted, it would be ignored and two
        # deployments would share queues.
        in_process = self.broker_url.startswith("memory://")  # one process: nothing shared
        if self.broker_key_prefix and not (is_redis_url(self.broker_url) or in_process):
            raise ValueError(
                "broker_key_prefix (CORRAL_BROKER_KEY_PREFIX) applies to a Redis broker "
                "only; on RabbitMQ give each deployment a vhost of its own "
                "(amqp://host:5672/<vhost>) and leave the prefix empty"
            )
        return self

    @property
    def open_networks(self) -> tuple[str, ...]:
        """``egress_open_networks`` as a tuple of host rules."""
        return split_list(self.egress_open_networks)

    def message_limits(self) -> Limits:
        """What reading one broker message may cost."""
        return Limits(
            raw_bytes=self.max_message_bytes,
            body_bytes=self.max_message_body_bytes,
            depth=self.max_message_depth,
        )

    def resolved_database_url(self) -> str:
        """The database URL, falling back to the embedded SQLite file."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.state_dir / 'corral.db'}"


class RunnerSettings(CommonSettings):
    """How a sandbox's runner reaches the api and what it may send it.

    The runner protocol's: the api answers runners, the provision and warm paths start
    them with these addresses and tokens, and the reaper ends those that never claimed.
    """

    control_url: str = Field(
        default="http://127.0.0.1:8300",
        description="How runners with network reach the api (http:// or https://).",
    )
    api_socket: Path | None = Field(
        default=None,
        description="api: Unix socket to listen on as well; default <state_dir>/run/api.sock. "
        "Sandboxes get its directory mounted read-only (so they reach an api that restarted "
        "and made a new socket): keep the socket in a directory of its own. "
        "Sandboxes without network reach the api through it.",
    )
    token_ttl_s: int = Field(
        default=900, gt=0, description="How long a registration token can be redeemed."
    )
    heartbeat_interval_s: float = Field(
        default=10.0, gt=0, description="How often runners heartbeat."
    )
    session_ttl_s: int = Field(
        default=86_400,
        gt=0,
        description="Runner session lifetime when the sandbox has no deadline of its own.",
    )
    log_budget_bytes: int = Field(
        default=16 * MIB,
        ge=0,
        description="api: log bytes stored per work item; lines past the budget (bytes or lines) "
        "are dropped and counted, and the runner is told.",
    )
    log_budget_lines: int = Field(
        default=100_000, ge=0, description="api: log lines stored per work item."
    )

    def resolved_api_socket(self) -> Path:
        """The api's Unix socket path."""
        return self.api_socket or self.state_dir / "run" / "api.sock"


class BreakerSettings(CommonSettings):
    """The pools' circuit breakers: provision failures open them, routing reads them.

    Inherited by :class:`IntakeSettings` (routing) and :class:`ProvisionSettings`.
    """

    breaker_failures: int = Field(
        default=5,
        ge=1,
        description="A pool's circuit breaker opens after this many provision failures in a "
        "row (transient ones included) within breaker_window_s; routing then skips the pool "
        "(docs/operations.md: circuit breakers).",
    )
    breaker_window_s: float = Field(
        default=300.0,
        gt=0,
        description="Failures further apart than this do not add up: the count restarts.",
    )
    breaker_cooldown_s: float = Field(
        default=60.0,
        gt=0,
        description="How long an open breaker keeps routing away before one probe item is let "
        "through (half open); its success closes the breaker, its failure opens it again.",
    )
    breaker_probe_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A probe that has neither succeeded nor failed after this (its provision "
        "lost) lets another probe through.",
    )


class BundleSettings(CommonSettings):
    """Result bundles: their limits, and the store that keeps the larger ones."""

    bundle_max_bytes: int = Field(
        default=100_000_000,
        gt=0,
        description="Result bundles: the most bytes one bundle's members may hold, "
        "uncompressed (its files, patches and manifest); past it the item fails "
        "bundle_too_large. The api's body limit for a bundle upload is this plus 1 % and "
        "1 MiB for the archive's own overhead.",
    )
    bundle_max_manifest_bytes: int = Field(
        default=5_000_000, gt=0, description="Result bundles: the largest manifest.json."
    )
    bundle_max_patches: int = Field(
        default=1000, gt=0, description="Result bundles: the most patches (diffs) in one."
    )
    bundle_store: Literal["filesystem", "s3"] = Field(
        default="filesystem",
        description="api: where bundles larger than bundle_inline_max_bytes are kept: a "
        "directory (bundle_dir; shared by every api replica) or an S3-compatible bucket "
        "(bundle_s3_*, with the s3 extra: pip install 'corral[s3]').",
    )
    bundle_inline_max_bytes: int = Field(
        default=1 * MIB,
        ge=0,
        description="api: bundles up to this size (compressed) are kept in the database row "
        "itself; 0: none.",
    )
    bundle_dir: Path | None = Field(
        default=None, description="api: the filesystem bundle store; default <state_dir>/bundles."
    )
    bundle_s3_bucket: str | None = Field(default=None, description="api: the S3 bucket.")
    bundle_s3_prefix: str = Field(default="bundles/", description="api: key prefix in it.")
    bundle_s3_endpoint_url: str | None = Field(
        default=None,
        description="api: an S3-compatible endpoint (MinIO, Ceph...); unset: AWS. Credentials "
        "come from boto3's usual chain (AWS_ACCESS_KEY_ID... or an instance role).",
    )
    bundle_s3_region: str | None = Field(default=None, description="api: the bucket's region.")

    def resolved_bundle_dir(self) -> Path:
        """The filesystem bundle store's directory."""
        return self.bundle_dir or self.state_dir / "bundles"

    def bundle_body_limit(self) -> int:
        """The largest bundle upload body: the content limit plus the archive's overhead."""
        return self.bundle_max_bytes + self.bundle_max_bytes // 100 + MIB


class SessionSettings(CommonSettings):
    """Interactive sessions (docs/sessions.md): their lifetimes and what one call may move."""

    interactive_idle_ttl_s: int = Field(
        default=600,
        gt=0,
        description="api: an interactive session's idle_ttl_s when its create call gives "
        "none: seconds without an exec or file call after which the reaper ends it "
        "(docs/sessions.md).",
    )
    interactive_idle_ttl_max_s: int = Field(
        default=86_400, gt=0, description="api: the largest idle_ttl_s a session may ask for."
    )
    interactive_ttl_s: int = Field(
        default=3600,
        gt=0,
        description="api: an interactive session's ttl_s when its create call gives none: "
        "its whole life from creation, however busy it is.",
    )
    interactive_ttl_max_s: int = Field(
        default=86_400, gt=0, description="api: the largest ttl_s a session may ask for."
    )
    interactive_exec_timeout_s: float = Field(
        default=60.0, gt=0, description="api: a session exec's timeout_s when it gives none."
    )
    interactive_exec_timeout_max_s: float = Field(
        default=600.0,
        gt=0,
        description="api: the largest timeout_s a session exec may ask for (the api holds a "
        "thread for it).",
    )
    interactive_output_max_bytes: int = Field(
        default=1 * MIB,
        gt=0,
        description="api: the most of an exec's stdout, and of its stderr, a session answers "
        "with; the provider keeps no more while the command runs, and the answer says "
        "truncated.",
    )
    interactive_file_max_bytes: int = Field(
        default=16 * MIB,
        gt=0,
        description="api: the largest file a session uploads (the PUT body's limit) or "
        "downloads (the provider refuses a larger one, copying no more than this and a byte).",
    )


# Result backends whose store_result needs the task's own request (its reply_to queue):
# the scheduler reads its queue itself and keeps no such request.
_REPLY_QUEUE_BACKENDS = ("rpc://", "amqp://", "amqps://", "pyamqp://")


class WebhookSettings(CommonSettings):
    """Org webhooks: which targets their deliveries may reach (corral.worker.outcome_sinks.webhook).

    The api reads ``webhook_allow_http`` when an endpoint is made; the maintenance worker
    checks each target address against ``webhook_open_networks`` before it connects, and
    prunes the delivery log past ``webhook_log_keep_s``.
    """

    webhook_allow_http: bool = Field(
        default=False,
        description="Accept webhook endpoints with an http:// URL (unencrypted); off, only "
        "https:// ones.",
    )
    webhook_open_networks: str = Field(
        default="",
        description="Webhook targets that may be reached although they are closed like "
        "sandbox egress (loopback, private, shared, link-local, the host's own addresses): "
        "comma-separated host rules, e.g. 10.1.2.0/24:443,127.0.0.1:8080. The deployment's "
        "alone: no org key can open an address.",
    )

    webhook_log_keep_s: float = Field(
        default=7 * 86400.0,
        gt=0,
        description="How long each try at delivering a webhook event stays in the delivery "
        "log (and can be read, and its event redelivered, from it); older tries are pruned "
        "hourly by the maintenance worker.",
    )

    @field_validator("webhook_open_networks")
    @classmethod
    def _webhook_open_networks(cls, value: str) -> str:
        return host_rules_setting(value, "CORRAL_WEBHOOK_OPEN_NETWORKS")

    @property
    def webhook_openings(self) -> tuple[str, ...]:
        """``webhook_open_networks`` as a tuple of host rules."""
        return split_list(self.webhook_open_networks)


class OutcomeSettings(WebhookSettings):
    """Telling each sender how its work ended: the result backend, and the delivery of the
    outcome outbox (corral.worker.outcome_delivery) by the maintenance worker.

    The intake reads ``result_backend`` to know whether a Celery message is owed its result.
    """

    result_backend: str | None = Field(
        default=None,
        description="A Celery result backend URL (redis://host:6379/1, db+postgresql://...): "
        "the final record of the item each corral.dispatch message made is stored there under "
        "the message's task id, so that the sender's AsyncResult(task_id).get() returns it, "
        "and the message's link and link_error callbacks are sent (docs/intake.md). Unset: "
        "no result is stored and no callback sent.",
    )
    callback_queues: str = Field(
        default="celery",
        description="Comma-separated globs of the queues a corral.dispatch message's link and "
        "link_error callbacks may go to (its options.queue; celery when it names none). Name "
        "only queues whose workers take callbacks from corral's senders: corral sends them "
        "with its own broker credentials, so no other system or tenant sharing the broker "
        "should read them. Empty: no callback is accepted. corral's and Celery's own queues "
        "are refused whatever it says.",
    )
    outcome_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="beat: how often the maintenance worker delivers the outcomes owed "
        "(a result stored, callbacks sent).",
    )
    outcome_cost_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="How long an item's outcome waits for the cost of its sandboxes (billed "
        "when each has ended, usually within seconds) before it is delivered without it.",
    )
    outcome_max_attempts: int = Field(
        default=20,
        gt=0,
        le=1000,
        description="Tries at delivering one outcome (backing off up to 10 minutes between "
        "them) before it is given up: kept as failed, counted, logged.",
    )
    outcome_claim_s: float = Field(
        default=120.0,
        ge=15,
        le=3600,
        description="How long a delivery run holds the outbox rows it took: the rows a "
        "killed maintenance worker held wait this long for another run. A run gives back the "
        "rows it has not reached 12 s before its claim ends (one delivery may take 10 s).",
    )

    @field_validator("result_backend")
    @classmethod
    def _backend_without_reply_queue(cls, value: str | None) -> str | None:
        if value is not None and value.strip() == "":
            return None
        if value is not None and value.startswith(_REPLY_QUEUE_BACKENDS):
            raise ValueError(
                "CORRAL_RESULT_BACKEND: the rpc and amqp backends answer on the sender's own "
                "reply queue, which corral does not keep; use redis://, a database (db+...) or "
                "another backend that stores results by task id"
            )
        return value


class IntakeSettings(BreakerSettings, OutcomeSettings):
    """Taking dispatches and routing them: the scheduler's intake, the api's, and re-drive.

    Routing skips a pool whose breaker is open, so the breakers' settings are inherited;
    a Celery message is owed its result when the outcomes' result backend is set.
    """

    intake_batch: int = Field(
        default=100,
        gt=0,
        le=10_000,
        description="scheduler: dispatch messages one intake loop takes at a time, at most "
        "(it takes what is waiting, it does not wait for a batch to fill).",
    )
    intake_lease_s: float = Field(
        default=10.0,
        ge=1,
        description="scheduler (Redis): a consumer that has not renewed its lease for this "
        "long counts as dead, and the messages it held are delivered again.",
    )
    budget_check_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="Routing reads an org's budgets and their spend at most this often per "
        "process (0: at every routing); a cap is noticed within it (docs/operations.md: "
        "budgets).",
    )
    sandbox_network: Literal["allow", "deny"] = Field(
        default="allow",
        description="intake: whether an item may ask for network (egress.allow_network); "
        "deny refuses it as network_not_allowed. CORRAL_SANDBOX_NETWORK_EXCEPT_ORGS names "
        "the orgs for which the other answer holds.",
    )
    sandbox_network_except_orgs: str = Field(
        default="",
        description="intake: comma-separated org ids for which sandbox_network is reversed "
        "(with deny: the orgs allowed network; with allow: the orgs refused it).",
    )
    item_images: str = Field(
        default="",
        description="intake: comma-separated patterns (globs, e.g. "
        "registry.example.com/shared/*) of the images an item may name in its `image` field, "
        "for orgs without a list of their own (`corral orgs policy set --item-images`); "
        "matched against the full reference (docker.io/library/ubuntu:24.04 for ubuntu:24.04). "
        "Empty: no item may name an image of its own, it runs its pool's.",
    )
    redrive_interval_s: float = Field(
        default=5.0, gt=0, description="beat: how often waiting and stranded items are routed."
    )
    redrive_batch: int = Field(default=200, gt=0, description="Items routed per re-drive.")
    routed_ttl_s: float = Field(
        default=900.0,
        ge=0,
        description="re-drive: an item routed this long ago whose queue no worker consumes "
        "(none said so in the last minute) fails as no_worker and its slot is freed, unless "
        "its pool sets a routed_ttl_s of its own (`corral pools update --routed-ttl-s`). 0: "
        "items wait for a worker for ever.",
    )
    priority_aging_s: float = Field(
        default=300.0,
        gt=0,
        description="admission: the head start each priority class has over the next one "
        "down (high over normal, normal over low), as seconds of waiting: an item that has "
        "waited this much longer than one a class above goes first, so no class starves.",
    )

    def network_allowed(self, org_id: str) -> bool:
        """Whether items of ``org_id`` may ask for network."""
        excepted = org_id in split_list(self.sandbox_network_except_orgs)
        return (self.sandbox_network == "allow") != excepted


class ProvisionSettings(BreakerSettings, RunnerSettings):
    """Provider workers making sandboxes: retries, batches and the provision lease.

    A failed provision counts towards its pool's breaker, and the sandbox's runner is
    given the api's address and a registration token: both those classes are inherited.
    """

    provision_max_retries: int = Field(
        default=5, ge=0, description="Retries of a transient provider error before failing."
    )
    provision_backoff_s: float = Field(
        default=1.0, gt=0, description="First retry delay; doubles each retry, with jitter."
    )
    provision_backoff_max_s: float = Field(default=60.0, gt=0)
    provision_batch_wait_s: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="Provider worker: while provisions arrive faster than their database "
        "batches run (claims, handles), how long a batch waits to fill before it runs. "
        "0: never waits.",
    )
    provision_lease_s: int = Field(
        default=600,
        gt=0,
        description="How long one provision attempt may hold a sandbox before a redelivered "
        "task may take it over.",
    )


class ReaperSettings(RunnerSettings):
    """The reaper (docs/reaper-and-costs.md): how often it sweeps and when it ends a sandbox.

    Its rules read the runner protocol's token lifetime (a sandbox never claimed).
    """

    reaper_interval_s: float = Field(
        default=15.0,
        gt=0,
        description="beat: how often the reaper sweeps (docs/reaper-and-costs.md).",
    )
    reaper_batch: int = Field(
        default=500, gt=0, description="reaper: sandboxes each rule ends per sweep, at most."
    )
    reaper_lock_ttl_s: float = Field(
        default=300.0,
        gt=0,
        description="reaper: the sweep lock's lease. A sweep renews it as it goes; a crashed "
        "sweep's lock expires after this.",
    )
    reconcile_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="reaper: how often each provider's own list of sandboxes is compared with "
        "the database (orphans, gone, died). Costs one list call per provider; 0: every sweep.",
    )
    provision_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="reaper: a sandbox still provisioning after this is ended (provision_stuck).",
    )
    finish_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="reaper: how long a sandbox may outlive its finished work item before the "
        "reaper ends it (finished).",
    )
    heartbeat_timeout_s: float = Field(
        default=60.0, gt=0, description="Silence after which a claimed sandbox counts as lost."
    )
    end_log_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="reaper: how long a batch of sandbox ends waits for their providers' own "
        "logs of the sandboxes that ended before their runner reported (the lines shown in the "
        "item's error); a provider slower than that is not waited for.",
    )


class WarmSettings(RunnerSettings):
    """Warm pools (docs/warm-pools.md): their refill, and the api's held warm waits.

    A warm sandbox's runner enrols with the api as a cold one registers, hence the runner
    protocol's settings.
    """

    warm_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="beat: how often warm pools are refilled to warm_min and their stale "
        "warm sandboxes ended (docs/warm-pools.md).",
    )
    warm_wait_s: float = Field(
        default=20.0,
        gt=0,
        le=120,
        description="api: how long one /v1/runner/warm/wait call is held before it answers "
        "'nothing yet' (the warm runner calls again at once).",
    )
    warm_poll_s: float = Field(
        default=0.05,
        gt=0,
        le=5,
        description="api: how often an api process looks, for all its held warm waits at once, "
        "whether their sandboxes were bound.",
    )


class ApiSettings(RunnerSettings, BundleSettings, SessionSettings, WebhookSettings):
    """The api: its listeners, request limits, rate limits, admin token and console cookie.

    It answers runners, takes bundle uploads and serves interactive sessions, whose
    settings it inherits (its body limits come from them).
    """

    api_host: str = Field(default="127.0.0.1", description="api: TCP address to listen on.")
    api_port: int = Field(default=8300, ge=0, le=65535, description="api: TCP port.")
    api_processes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="api: processes serving the listeners on this host (one interpreter "
        "uses at most one core; more than 1 needs a shared database, PostgreSQL).",
    )
    end_batch_s: float = Field(
        default=1.0,
        ge=0,
        le=30,
        description="api: how long the sandboxes whose work finished are gathered before "
        "they are sent to the maintenance worker to end as one batch; 0: each at once.",
    )
    api_metrics_host: str = Field(
        default="127.0.0.1", description="api: address of its Prometheus metrics listener."
    )
    api_metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="api: serve Prometheus metrics on this TCP port, a listener of its own "
        "(never on the api's port or socket). Unset: the api serves no metrics.",
    )
    api_body_limit_dispatch: int = Field(
        default=2 * MIB,
        gt=0,
        description="api: largest request body of POST /v1/dispatch, in bytes; larger ones are "
        "refused with 413 without being kept.",
    )
    api_body_limit_complete: int = Field(
        default=2 * MIB,
        gt=0,
        description="api: largest body of the runner's complete call (its result may be up to "
        "1,000,000 bytes of JSON), in bytes.",
    )
    api_body_limit_logs: int = Field(
        default=1 * MIB, gt=0, description="api: largest body of the runner's logs call, in bytes."
    )
    api_body_limit_default: int = Field(
        default=64 * KIB, gt=0, description="api: largest request body of every other route."
    )
    api_json_max_depth: int = Field(
        default=MAX_DEPTH,
        gt=0,
        le=1000,
        description="api: deepest nesting of arrays and objects a JSON request body may have; "
        "deeper ones are refused with 422.",
    )
    runner_rate_per_s: float = Field(
        default=20.0,
        ge=0,
        description="api: runner calls per second per runner session (token bucket, per api "
        "replica); past it, 429 with Retry-After. 0: no limit.",
    )
    runner_rate_burst: int = Field(
        default=100, gt=0, description="api: runner calls a session may make at once."
    )
    runner_address_rate_per_s: float = Field(
        default=500.0,
        ge=0,
        description="api: runner calls per second per source address, all sessions together "
        "(callers on the Unix socket count as one address). 0: no limit.",
    )
    runner_address_burst: int = Field(
        default=1000, gt=0, description="api: runner calls one address may make at once."
    )
    register_rate_per_s: float = Field(
        default=10.0,
        ge=0,
        description="api: runner registrations per second per source address. 0: no limit.",
    )
    register_burst: int = Field(
        default=100, gt=0, description="api: registrations one address may make at once."
    )
    api_key_cache_ttl_s: float = Field(
        default=5.0,
        ge=0,
        le=300,
        description="api: how long an api process keeps an org key it found live before it "
        "reads the key's row again; a key revoked elsewhere is refused by every api process "
        "at most this long after (at once by the one that revoked it). 0: read every time.",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for dispatch, admin and read endpoints of the api. Unset: "
        "those endpoints answer 503.",
    )
    console_insecure_cookie: bool = Field(
        default=False,
        description="api: set the web console's cookies without Secure, so that a browser "
        "sends them over plain http. For development on plain http only (`corral dev` sets "
        "it for its own loopback api); behind TLS leave it false.",
    )
    cost_unit: str = Field(
        default="unit",
        min_length=1,
        max_length=16,
        pattern=r"^[^\x00-\x1f\x7f<>&\"']+$",
        description="the currency the pools' rate cards are in (rate_micros are its "
        "millionths), as the console names it beside every amount and rate, e.g. USD or "
        "EUR. A label: corral converts nothing.",
    )


class ClientSettings(ApiSettings):
    """The commands that talk to the api: where it is and which key they use.

    Without ``api_url`` they fall back to the api's own host and port, and without an org
    key to its admin token: :class:`ApiSettings` is inherited.
    """

    api_url: str | None = Field(
        default=None,
        description="CLI: where the api is (`corral dispatch` sends through it, `corral "
        "status`). Unset: <state_dir>/api-url, which `corral dev` writes, else "
        "http://api_host:api_port when an api answers there.",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="An org key (cok_...) the commands that talk to the api use instead of "
        "the admin token: they then act for that org only, with the key's scopes.",
    )


class CoreSettings(ClientSettings, IntakeSettings, ProvisionSettings, ReaperSettings, WarmSettings):
    """Every component's settings in one object: what a process builds and its runtime holds.

    Hand a function the narrowest class it needs (e.g. :class:`ReaperSettings`); this one
    only where something truly needs all of them (a process's start, its runtime).
    """


COMPONENTS: tuple[type[CommonSettings], ...] = (
    CommonSettings,
    RunnerSettings,
    BreakerSettings,
    WebhookSettings,
    OutcomeSettings,
    IntakeSettings,
    ProvisionSettings,
    ReaperSettings,
    WarmSettings,
    BundleSettings,
    SessionSettings,
    ApiSettings,
    ClientSettings,
)
"""The component classes, each declaring its own fields; :class:`CoreSettings` has them all."""


def component_name(component: type[CommonSettings]) -> str:
    """A component's short name: ``IntakeSettings`` is ``intake``."""
    return component.__name__.removesuffix("Settings").lower()


def declared_in(name: str) -> type[CommonSettings]:
    """The component class that declares the field ``name``.

    Raises:
        KeyError: no component declares it.
    """
    for component in COMPONENTS:
        if name in vars(component).get("__annotations__", {}):
            return component
    raise KeyError(name)
