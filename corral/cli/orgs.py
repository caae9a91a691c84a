"""``corral orgs``: an org's api keys (made, listed, revoked), its webhook endpoints (made,
listed, removed, their delivery log, an event sent again), its limit on work in flight
across all its pools and its weight in the division of shared capacity. Works on the
database directly, like ``corral pools``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from corral.cli.output import FormatOption, OutputFormat, escape_controls, fail, runtime

orgs_app = typer.Typer(help="Org api keys, webhooks, org-wide limits and weights.")
keys_app = typer.Typer(help="Api keys that act for one org (cok_...), with scopes.")
orgs_app.add_typer(keys_app, name="keys")

Org = Annotated[str, typer.Argument(help="The org.")]


def _shown_once(made: str, secret: str) -> None:
    """What was made, on standard error; its secret alone on standard output, so that
    ``$(corral orgs ...)`` takes it. corral keeps no copy it could show again."""
    typer.echo(made, err=True)
    typer.echo(secret)


def _listed(
    rows: Sequence[dict[str, Any]],
    output_format: OutputFormat,
    header: Sequence[str],
    cells: Callable[[dict[str, Any]], list[str]],
    empty: str,
) -> None:
    """``rows`` as JSON, or as a table of each row's ``cells`` (``empty`` when none)."""
    from corral.cli.inspect import format_table

    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(list(rows), indent=2, default=str))
        return
    table = [[escape_controls(cell) for cell in cells(row)] for row in rows]
    typer.echo(format_table(header, table) if table else empty)


def _ended(done: bool, org: str, noun: str, thing_id: str, *, verb: str, group: str) -> None:
    """Say that the org's ``noun`` was ended (revoked, removed), or fail when it had no
    such live one."""
    if not done:
        raise fail(f"org {org} has no live {noun} {thing_id}: see `corral orgs {group} list {org}`")
    typer.echo(f"{noun} {thing_id} {verb}")


@keys_app.command("create")
def keys_create(
    org: Org,
    scope: Annotated[
        list[str], typer.Option(help="dispatch, read, review or admin (repeat for several).")
    ],
    name: Annotated[str, typer.Option(help="What the key is for.")] = "key",
) -> None:
    """Make a key and print it once: corral keeps only its hash."""
    from corral.shared.store.api_keys import ApiKeyError, create_key

    try:
        with runtime().db.session() as session:
            key_id, token = create_key(session, org, name, scope)
    except ApiKeyError as exc:
        raise fail(str(exc)) from exc
    _shown_once(f"key {key_id} for org {org} ({', '.join(sorted(set(scope)))}):", token)


@keys_app.command("list")
def keys_list(org: Org, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The org's keys (never the keys themselves)."""
    from corral.shared.store.api_keys import list_keys

    with runtime().db.session() as session:
        rows = list_keys(session, org)
    _listed(
        rows,
        output_format,
        ["id", "name", "scopes", "state"],
        lambda r: [r["id"], r["name"], ",".join(r["scopes"]), _state(r["revoked_at"], "revoked")],
        "no keys",
    )


def _state(ended_at: Any, ended: str) -> str:
    return ended if ended_at else "live"


@keys_app.command("revoke")
def keys_revoke(org: Org, key_id: Annotated[str, typer.Argument(help="The key's id.")]) -> None:
    """Revoke a key: the api refuses it from the next request on."""
    from corral.shared.store.api_keys import revoke_key

    with runtime().db.session() as session:
        done = revoke_key(session, org, key_id)
    _ended(done, org, "key", key_id, verb="revoked", group="keys")


@orgs_app.command("limit")
def orgs_limit(
    org: Org,
    max_concurrent: Annotated[
        int | None, typer.Option(help="Items in flight across the org's pools at most.")
    ] = None,
    remove: Annotated[bool, typer.Option("--remove", help="Remove the org's limit.")] = False,
) -> None:
    """Show, set or remove the org's limit on work in flight across all its pools."""
    from corral.shared.store.org_limits import in_flight, org_limit, set_limit

    if max_concurrent is not None and remove:
        raise fail("give --max-concurrent or --remove, not both")
    with runtime().db.session() as session:
        try:
            if max_concurrent is not None or remove:
                set_limit(session, org, None if remove else max_concurrent)
        except ValueError as exc:
            raise fail(f"--max-concurrent: {exc}") from exc
        session.flush()
        limit, held = org_limit(session, org), in_flight(session, org)
    shown = "no limit" if limit is None else f"at most {limit} in flight"
    typer.echo(f"org {org}: {shown}; {held} in flight now")


@orgs_app.command("weight")
def orgs_weight(
    org: Org,
    weight: Annotated[
        int | None,
        typer.Argument(
            help="Its weight, 1 to 1000: on every shared capacity its pool gets a part of "
            "the slots in proportion to it (omitted: show it)."
        ),
    ] = None,
    reset: Annotated[bool, typer.Option("--reset", help="Set it back to the default (1).")] = False,
) -> None:
    """Show, set or reset the org's weight in the division of shared capacity."""
    from corral.scheduler.admin.capacities import org_weight, set_org_weight
    from corral.scheduler.admin.pools import AdminError

    if weight is not None and reset:
        raise fail("give a weight or --reset, not both")
    db = runtime().db
    try:
        if weight is not None or reset:
            shown = set_org_weight(db, org, weight)
        else:
            shown = org_weight(db, org)
    except AdminError as exc:
        raise fail(exc.message) from exc
    said = " (the default)" if shown["default"] else ""
    typer.echo(f"org {org}: weight {shown['weight']}{said}")


policy_app = typer.Typer(help="What the deployment lets an org's work ask for.")
orgs_app.add_typer(policy_app, name="policy")
Patterns = Annotated[
    str | None,
    typer.Option(help="Comma-separated glob patterns; 'default' goes back to the deployment's."),
]


def _patterns(value: str | None, kept: list[str] | None) -> list[str] | None:
    if value is None:
        return kept
    if value.strip() == "default":
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


@policy_app.command("show")
def policy_show(org: Org, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The images the org's items may name and the regions they may ask for."""
    from corral.shared.store.org_policies import policy_document, stored_of

    with runtime().db.session() as session:
        document = policy_document(org, stored_of(session, [org]))
    if output_format is OutputFormat.JSON:
        typer.echo(json.dumps(document, indent=2))
        return
    images, regions = document["item_images"], document["regions"]
    typer.echo(f"org {org}")
    typer.echo(
        "  item images: "
        + (", ".join(images) if images is not None else "the deployment's (CORRAL_ITEM_IMAGES)")
    )
    typer.echo("  regions: " + (", ".join(regions) if regions is not None else "any"))


@policy_app.command("set")
def policy_set(
    org: Org,
    item_images: Annotated[
        str | None,
        typer.Option(
            help="Image patterns its items may name, on the full reference "
            "(e.g. 'registry.example.com/acme/*'); 'default': CORRAL_ITEM_IMAGES."
        ),
    ] = None,
    regions: Patterns = None,
) -> None:
    """Set what the org's work may ask for; what is not given keeps its value."""
    from corral.shared.store.org_policies import set_policy, stored_of

    if item_images is None and regions is None:
        raise fail("give --item-images, --regions or both")
    with runtime().db.session() as session:
        kept_images, kept_regions = stored_of(session, [org]).get(org, (None, None))
        try:
            set_policy(
                session,
                org,
                item_images=_patterns(item_images, kept_images),
                regions=_patterns(regions, kept_regions),
            )
        except ValueError as exc:
            raise fail(str(exc)) from exc
    policy_show(org)


webhooks_app = typer.Typer(help="Webhook endpoints: URLs sent the org's signed events.")
orgs_app.add_typer(webhooks_app, name="webhooks")


@webhooks_app.command("add")
def webhooks_add(
    org: Org,
    url: Annotated[
        str, typer.Argument(help="https://... (http:// with CORRAL_WEBHOOK_ALLOW_HTTP).")
    ],
    event: Annotated[
        list[str] | None,
        typer.Option(
            help="An event to send (repeat): item.final, item.dispatch_error, sandbox.ended, "
            "budget.threshold; default: item.final."
        ),
    ] = None,
) -> None:
    """Add an endpoint and print its signing secret once: corral keeps it sealed."""
    from corral.shared.keyring import required_keyring
    from corral.shared.store.webhooks import ITEM_FINAL, WebhookError, create_endpoint

    rt = runtime()
    if rt.settings.secret_key is None:
        raise fail("webhook secrets are stored sealed with CORRAL_SECRET_KEY: set it first")
    keyring = required_keyring(rt.settings)
    try:
        with rt.db.session() as session:
            document, secret = create_endpoint(
                session,
                keyring,
                org,
                url,
                event or [ITEM_FINAL],
                allow_http=rt.settings.webhook_allow_http,
            )
    except WebhookError as exc:
        raise fail(exc.message) from exc
    _shown_once(
        f"webhook {document['id']} for org {org} ({', '.join(document['events'])}):", secret
    )


@webhooks_app.command("list")
def webhooks_list(org: Org, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The org's endpoints (never their secrets)."""
    from corral.shared.store.webhooks import list_endpoints

    with runtime().db.session() as session:
        rows = list_endpoints(session, org)
    _listed(
        rows,
        output_format,
        ["id", "url", "events", "state"],
        lambda r: [r["id"], r["url"], ",".join(r["events"]), _state(r["disabled_at"], "removed")],
        "no webhooks",
    )


WebhookId = Annotated[str, typer.Argument(help="The endpoint's id (wh-...).")]


@webhooks_app.command("remove")
def webhooks_remove(org: Org, webhook_id: WebhookId) -> None:
    """Remove an endpoint: it is sent nothing more."""
    from corral.shared.store.webhooks import remove_endpoint

    with runtime().db.session() as session:
        done = remove_endpoint(session, org, webhook_id)
    _ended(done, org, "webhook", webhook_id, verb="removed", group="webhooks")


def _outcome(entry: dict[str, Any]) -> str:
    """A try's outcome in a word or two: the status, or why there was none."""
    if entry["status"] is not None:
        return str(entry["status"])
    return str(entry["error"] or "no answer")


@webhooks_app.command("deliveries")
def webhooks_deliveries(
    org: Org,
    webhook_id: WebhookId,
    limit: Annotated[int, typer.Option(min=1, max=200, help="Tries to show at most.")] = 50,
    before: Annotated[
        int | None, typer.Option(min=1, help="Only tries older than this one (its id).")
    ] = None,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """The tries at delivering the endpoint's events, newest first."""
    from corral.shared.store.webhook_log import deliveries
    from corral.shared.store.webhooks import endpoint_of

    with runtime().db.session() as session:
        if endpoint_of(session, org, webhook_id) is None:
            raise fail(
                f"org {org} has no webhook {webhook_id}: see `corral orgs webhooks list {org}`"
            )
        rows = deliveries(session, org, webhook_id, limit=limit, before=before)
    _listed(
        rows,
        output_format,
        ["id", "at", "event", "type", "item", "try", "answer", "owed"],
        lambda r: [
            str(r["id"]),
            f"{r['at']:%Y-%m-%d %H:%M:%S}",
            r["event_id"],
            r["event_type"],
            r["work_item_id"] or "-",
            str(r["attempt"]),
            _outcome(r),
            r["owed"] or "-",
        ],
        "no deliveries logged",
    )


@webhooks_app.command("redeliver")
def webhooks_redeliver(
    org: Org, event_id: Annotated[str, typer.Argument(help="The event's id (evt_...).")]
) -> None:
    """Send one of the org's events again, with its own id, delivered or given up."""
    from corral.shared.store.db import utcnow
    from corral.shared.store.webhook_log import EndpointRemovedError, UnknownEventError, redeliver

    try:
        with runtime().db.session() as session:
            done = redeliver(session, org, event_id, now=utcnow())
    except (UnknownEventError, EndpointRemovedError) as exc:
        raise fail(exc.message) from exc
    typer.echo(
        f"event {event_id} ({done['event_type']}) owed again to webhook {done['endpoint_id']}"
    )
