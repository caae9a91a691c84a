"""``corral orgs``: an org's api keys (made, listed, revoked), its webhook endpoints, and its
limit on work in flight across all its pools. Works on the database directly, like
``corral pools``."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from corral.cli.output import FormatOption, OutputFormat, fail, runtime

orgs_app = typer.Typer(help="Org api keys, webhooks and org-wide limits.")
keys_app = typer.Typer(help="Api keys that act for one org (cok_...), with scopes.")
orgs_app.add_typer(keys_app, name="keys")

Org = Annotated[str, typer.Argument(help="The org.")]


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
    typer.echo(f"key {key_id} for org {org} ({', '.join(sorted(set(scope)))}):", err=True)
    typer.echo(token)  # alone on stdout, so that `$(corral orgs keys create ...)` takes it


@keys_app.command("list")
def keys_list(org: Org, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The org's keys (never the keys themselves)."""
    from corral.cli.inspect import format_table
    from corral.shared.store.api_keys import list_keys

    with runtime().db.session() as session:
        rows = list_keys(session, org)
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    table = [
        [r["id"], r["name"], ",".join(r["scopes"]), "revoked" if r["revoked_at"] else "live"]
        for r in rows
    ]
    typer.echo(format_table(["id", "name", "scopes", "state"], table) if table else "no keys")


@keys_app.command("revoke")
def keys_revoke(org: Org, key_id: Annotated[str, typer.Argument(help="The key's id.")]) -> None:
    """Revoke a key: the api refuses it from the next request on."""
    from corral.shared.store.api_keys import revoke_key

    with runtime().db.session() as session:
        if not revoke_key(session, org, key_id):
            raise fail(f"org {org} has no live key {key_id}: see `corral orgs keys list {org}`")
    typer.echo(f"key {key_id} revoked")


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
        list[str] | None, typer.Option(help="An event to send (repeat); default: item.final.")
    ] = None,
) -> None:
    """Add an endpoint and print its signing secret once: corral keeps it sealed."""
    from corral.providers.credentials import CredentialCipher
    from corral.shared.store.webhooks import ITEM_FINAL, WebhookError, create_endpoint

    rt = runtime()
    if rt.settings.secret_key is None:
        raise fail("webhook secrets are stored sealed with CORRAL_SECRET_KEY: set it first")
    cipher = CredentialCipher(rt.settings.secret_key)
    try:
        with rt.db.session() as session:
            document, secret = create_endpoint(
                session,
                cipher,
                org,
                url,
                event or [ITEM_FINAL],
                allow_http=rt.settings.webhook_allow_http,
            )
    except WebhookError as exc:
        raise fail(exc.message) from exc
    typer.echo(
        f"webhook {document['id']} for org {org} ({', '.join(document['events'])}):", err=True
    )
    typer.echo(secret)  # alone on stdout, so that `$(corral orgs webhooks add ...)` takes it


@webhooks_app.command("list")
def webhooks_list(org: Org, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The org's endpoints (never their secrets)."""
    from corral.cli.inspect import format_table
    from corral.shared.store.webhooks import list_endpoints

    with runtime().db.session() as session:
        rows = list_endpoints(session, org)
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    table = [
        [r["id"], r["url"], ",".join(r["events"]), "removed" if r["disabled_at"] else "live"]
        for r in rows
    ]
    typer.echo(format_table(["id", "url", "events", "state"], table) if table else "no webhooks")


@webhooks_app.command("remove")
def webhooks_remove(
    org: Org, webhook_id: Annotated[str, typer.Argument(help="The endpoint's id (wh-...).")]
) -> None:
    """Remove an endpoint: it is sent nothing more."""
    from corral.shared.store.webhooks import remove_endpoint

    with runtime().db.session() as session:
        if not remove_endpoint(session, org, webhook_id):
            raise fail(
                f"org {org} has no live webhook {webhook_id}: see `corral orgs webhooks list {org}`"
            )
    typer.echo(f"webhook {webhook_id} removed")
