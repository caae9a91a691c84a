"""The console's pool, provider and cost pages: the admin api's functions behind forms."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError

from corral.scheduler.admin import budgets as budget_admin
from corral.scheduler.admin import capacities, overview, views
from corral.scheduler.admin import pools as admin
from corral.scheduler.admin import providers as provider_admin
from corral.scheduler.api.auth import Scope
from corral.scheduler.api.console import cells, charts, forms, queries
from corral.scheduler.api.console import session as sessions
from corral.scheduler.api.console.render import page, read_form, redirect
from corral.scheduler.api.console.session import ConsoleSession
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.errors import ConfigurationError
from corral.shared.messages import describe_field_errors, field_errors
from corral.shared.runtime import Runtime
from corral.shared.store import provider_configs
from corral.shared.store.db import Database, utcnow
from corral.shared.store.ledger import CostGrouping, format_micros, parse_since
from corral.shared.store.pools import VIEW_COLUMNS, PoolView
from corral.shared.text import IDENTIFIER

router = APIRouter(prefix="/console", include_in_schema=False)
Session = Annotated[ConsoleSession, Depends(sessions.current)]
PoolId = Annotated[str, Path(pattern=IDENTIFIER)]
ProviderId = Annotated[str, Path(pattern=IDENTIFIER)]
POOL_NUMBERS = (
    "priority",
    "max_concurrent",
    "max_concurrent_ceiling",
    "rate_micros",
    "warm_min",
    "warm_idle_ttl_s",
)
POOL_OBJECTS = ("runtime_provides", "capabilities", "warm_schedule")
LEASE_SCHEMA = admin.PoolLease.model_json_schema()


# -- pools ---------------------------------------------------------------------------------


@router.get("/pools")
def pools_page(session: Session, rt: ApiRuntime) -> HTMLResponse:
    rows = overview.pool_rows(rt.db, session.principal.org_filter(None))
    return page("pools.html", session, nav="pools", pools=rows)


def _visible_pool(rt: Runtime, session: ConsoleSession, pool_id: str) -> dict[str, Any]:
    try:
        pool = admin.find_pool(rt.db, None, pool_id)
    except admin.AdminError:
        pool = None
    if pool is None or not session.principal.sees(pool["org_id"]):
        raise HTTPException(status_code=404, detail="pool not found")
    return pool


def _pool_page(
    rt: Runtime,
    session: ConsoleSession,
    pool: dict[str, Any],
    *,
    error: str = "",
    status: int = 200,
    submitted: dict[str, str] | None = None,
) -> HTMLResponse:
    """The pool's page; after a refused edit, its form shows what was submitted."""
    options: dict[str, Any] = {}
    schema_problem = ""
    try:
        options = provider_admin.provider_schema(pool["provider_id"])["options"]
    except admin.AdminError as exc:
        schema_problem = exc.message
    rows = overview.pool_rows(rt.db, pool["org_id"])
    [row] = [r for r in rows if r["id"] == pool["id"]]
    effective = PoolView.build(**{name: pool[name] for name in VIEW_COLUMNS})
    capabilities = effective.capabilities.model_dump(mode="json")
    unit = rt.settings.cost_unit
    billing = pool["billing_model"] or capabilities["billing_model"]
    lease = pool["lease"] or {}
    deployment = session.principal.is_deployment_admin
    if submitted is not None:
        lease = {**lease, **_typed(LEASE_SCHEMA, forms.submitted(submitted, "lease"))}
    return page(
        "pool.html",
        session,
        nav="pools",
        pool=pool,
        row=row,
        capabilities=capabilities,
        rate=cells.rate(billing, pool["rate_micros"], unit),
        billing=billing,
        unit=unit,
        option_fields=_option_fields(options, pool, submitted),
        lease_fields=forms.fields(LEASE_SCHEMA, lease, prefix="lease"),
        schema_problem=schema_problem,
        values=_pool_values(pool, submitted),
        deployment=deployment,
        capacity_names=capacities.capacity_names(rt.db) if deployment else [],
        error=error,
        status=status,
    )


def _pool_values(pool: dict[str, Any], submitted: dict[str, str] | None) -> dict[str, str]:
    """The edit form's values: the pool's, or those submitted."""
    values = {name: str(pool[name]) for name in POOL_NUMBERS}
    values["name"] = pool["name"]
    values["billing_model"] = pool["billing_model"] or ""
    values["routed_ttl_s"] = "" if pool["routed_ttl_s"] is None else str(pool["routed_ttl_s"])
    values["capacity"] = pool["capacity"] or ""
    for name in POOL_OBJECTS:
        values[name] = json.dumps(pool[name], indent=2) if pool[name] else ""
    if submitted is not None:
        values.update({k: v for k, v in submitted.items() if k in values})
    return values


def _option_fields(
    options: dict[str, Any], pool: dict[str, Any], submitted: dict[str, str] | None
) -> list[forms.Field]:
    if not options:
        return []
    if submitted is None:
        return forms.fields(options, pool["sandbox_config"])
    texts = forms.submitted(submitted)
    return forms.fields(options, {**pool["sandbox_config"], **_typed(options, texts)})


@router.get("/pools/{pool_id}")
def pool_page(session: Session, pool_id: PoolId, rt: ApiRuntime) -> HTMLResponse:
    return _pool_page(rt, session, _visible_pool(rt, session, pool_id))


async def _pool_change(
    rt: Runtime, request: Request, session: ConsoleSession, pool_id: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """The submitted form and the pool it changes, once the caller may change it."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    pool = _visible_pool(rt, session, pool_id)
    sessions.require(session, Scope.ADMIN, pool["org_id"])
    return form, pool


@router.post("/pools/{pool_id}/active")
async def pool_active(
    request: Request, session: Session, pool_id: PoolId, rt: ApiRuntime
) -> Response:
    form, _ = await _pool_change(rt, request, session, pool_id)
    update = admin.PoolUpdate(active=form.get("active") == "true")
    admin.update_pool(rt.db, pool_id, update, by_deployment=session.principal.is_deployment_admin)
    return redirect(f"/console/pools/{pool_id}", request)


def _pool_update(
    form: dict[str, str], options: dict[str, Any], *, deployment: bool
) -> admin.PoolUpdate:
    """The form's update: of every field (the deployment's form), or of the org's fields
    alone (an org key's, which shows no other). Raises: forms.FormError, ValidationError."""
    fields: dict[str, Any] = {
        name: form[name].strip() for name in (*POOL_NUMBERS, "name") if form.get(name, "").strip()
    }
    if not deployment:
        return admin.PoolUpdate.model_validate(
            {name: value for name, value in fields.items() if name in admin.ORG_FIELDS}
        )
    # The lease policy as a whole, as the admin api takes it: no field filled clears it.
    fields["lease"] = forms.document(LEASE_SCHEMA, form, {}, prefix="lease")
    for name in POOL_OBJECTS:
        text = form.get(name, "").strip()
        try:
            fields[name] = json.loads(text) if text else None
        except ValueError:
            raise forms.FormError(f"{name}: not valid JSON") from None
    if form.get("billing_model"):
        fields["billing_model"] = form["billing_model"]
    fields["routed_ttl_s"] = form.get("routed_ttl_s", "").strip() or None  # empty: the default
    if "capacity" in form:  # empty: on none
        fields["capacity"] = form["capacity"].strip() or None
    fields["sandbox_config"] = forms.document(options, form, {}) if options else {}
    return admin.PoolUpdate.model_validate(fields)


@router.post("/pools/{pool_id}")
async def pool_edit(
    request: Request, session: Session, pool_id: PoolId, rt: ApiRuntime
) -> Response:
    form, pool = await _pool_change(rt, request, session, pool_id)
    try:
        options = provider_admin.provider_schema(pool["provider_id"])["options"]
        deployment = session.principal.is_deployment_admin
        update = _pool_update(form, options, deployment=deployment)
        admin.update_pool(rt.db, pool_id, update, by_deployment=deployment)
    except (forms.FormError, ValidationError, admin.AdminError) as exc:
        if isinstance(exc, ValidationError):
            message = f"invalid: {describe_field_errors(field_errors(exc, admin.PoolUpdate))}"
        else:
            message = exc.message if isinstance(exc, admin.AdminError) else str(exc)
        return _pool_page(rt, session, pool, error=message, status=422, submitted=form)
    return redirect(f"/console/pools/{pool_id}", request)


@router.get("/pools/{pool_id}/delete")
def pool_delete_form(session: Session, pool_id: PoolId, rt: ApiRuntime) -> HTMLResponse:
    """Deleting a pool asks once more, on a page of its own."""
    pool = _visible_pool(rt, session, pool_id)
    _deployment_admin(session)
    return page("pool_delete.html", session, nav="pools", pool=pool)


@router.post("/pools/{pool_id}/delete")
async def pool_delete(
    request: Request, session: Session, pool_id: PoolId, rt: ApiRuntime
) -> Response:
    """Delete the pool, as `corral pools delete` does: refused while it has items in
    flight (its page says why)."""
    sessions.check_csrf(session, request, await read_form(request))
    pool = _visible_pool(rt, session, pool_id)
    _deployment_admin(session)  # as the admin api: an org key may disable its pool only
    try:
        admin.delete_pool(rt.db, pool_id)
    except admin.AdminError as exc:
        return _pool_page(rt, session, pool, error=exc.message, status=409)
    return redirect("/console/pools", request)


# -- providers -----------------------------------------------------------------------------


@router.get("/providers")
def providers_page(session: Session) -> HTMLResponse:
    providers = provider_admin.list_providers()
    flat = [cells.flat(p["capabilities"]) for p in providers]
    names = sorted({name for capabilities in flat for name in capabilities})
    rows = [
        (cells.label(name), [cells.cell(name, one.get(name)) if one else "" for one in flat])
        for name in names
    ]
    return page("providers.html", session, nav="providers", providers=providers, rows=rows)


def _provider_page(
    rt: Runtime,
    session: ConsoleSession,
    provider_id: str,
    *,
    error: str = "",
    saved: bool = False,
    submitted: dict[str, Any] | None = None,
    status: int = 200,
) -> HTMLResponse:
    found = [p for p in provider_admin.list_providers() if p["id"] == provider_id]
    if not found:
        raise HTTPException(status_code=404, detail="provider not found")
    info = found[0]
    context: dict[str, Any] = {"schema_problem": "", "fields": [], "document": None}
    if session.principal.is_deployment_admin:
        try:
            schema = provider_admin.provider_schema(provider_id)["config"]
            document = provider_admin.config_document(rt, provider_id)
            as_set = provider_configs.effective_config(rt.db, rt.settings, provider_id).config
            shown = {k: document["config"].get(k) for k in as_set}
            context.update(
                document=document, fields=forms.fields(schema, {**shown, **(submitted or {})})
            )
        except admin.AdminError as exc:
            context["schema_problem"] = exc.message
    org = session.principal.org_filter(None)
    context["credentials"] = queries.credential_orgs(rt.db, provider_id, org)
    return page(
        "provider.html",
        session,
        nav="providers",
        provider=info,
        error=error,
        saved=saved,
        status=status,
        **context,
    )


@router.get("/providers/{provider_id}")
def provider_page(session: Session, provider_id: ProviderId, rt: ApiRuntime) -> HTMLResponse:
    return _provider_page(rt, session, provider_id)


def _deployment_admin(session: ConsoleSession) -> None:
    if not (session.principal.is_deployment_admin and Scope.ADMIN in session.principal.scopes):
        raise HTTPException(status_code=403, detail="only the deployment admin")


@router.post("/providers/{provider_id}/config")
async def provider_config(
    request: Request, session: Session, provider_id: ProviderId, rt: ApiRuntime
) -> Response:
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    _deployment_admin(session)
    try:
        schema = provider_admin.provider_schema(provider_id)["config"]
    except admin.AdminError as exc:
        if isinstance(exc, LookupError):
            raise HTTPException(status_code=404, detail="provider not found") from exc
        return _provider_page(rt, session, provider_id, error=exc.message, status=422)
    try:
        stored = provider_configs.effective_config(rt.db, rt.settings, provider_id).config
        provider_admin.set_config(rt, provider_id, forms.document(schema, form, stored))
    except (forms.FormError, admin.AdminError) as exc:
        message = exc.message if isinstance(exc, admin.AdminError) else str(exc)
        secret = {f.name for f in forms.fields(schema, {}) if f.kind == "secret"}
        submitted = {k: v for k, v in forms.submitted(form).items() if k not in secret}
        return _provider_page(
            rt, session, provider_id, error=message, submitted=_typed(schema, submitted), status=422
        )
    return _provider_page(rt, session, provider_id, saved=True)


@router.post("/providers/{provider_id}/config/forget")
async def provider_config_forget(
    request: Request, session: Session, provider_id: ProviderId, rt: ApiRuntime
) -> Response:
    """Forget the stored settings: CORRAL_PROVIDER_CONFIG's entry (or the defaults) again."""
    sessions.check_csrf(session, request, await read_form(request))
    _deployment_admin(session)
    try:
        provider_admin.remove_config(rt, provider_id)
    except admin.AdminError as exc:
        raise HTTPException(status_code=404, detail="provider not found") from exc
    return redirect(f"/console/providers/{provider_id}", request)


async def _credential_change(
    request: Request, session: ConsoleSession
) -> tuple[dict[str, str], str]:
    """The submitted form and its org, once the caller may change that org's credentials."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    org = sessions.admin_org(session, form.get("org"))
    if org is None:
        raise HTTPException(status_code=422, detail="org: an org id (letters, digits, - _ .)")
    return form, org


@router.post("/providers/{provider_id}/credentials")
async def credential_store(
    request: Request, session: Session, provider_id: ProviderId, rt: ApiRuntime
) -> Response:
    """Store an org's credential for the provider (encrypted with CORRAL_SECRET_KEY)."""
    form, org = await _credential_change(request, session)
    secret = form.get("secret", "")
    if not secret:
        return _provider_page(rt, session, provider_id, error="secret: required", status=422)
    try:
        provider_admin.set_credential(rt, org, provider_id, secret)
    except admin.AdminError as exc:
        raise HTTPException(status_code=404, detail="provider not found") from exc
    except ConfigurationError as exc:
        return _provider_page(rt, session, provider_id, error=exc.message, status=409)
    return redirect(f"/console/providers/{provider_id}", request)


@router.post("/providers/{provider_id}/credentials/forget")
async def credential_forget(
    request: Request, session: Session, provider_id: ProviderId, rt: ApiRuntime
) -> Response:
    """Forget an org's credential for the provider."""
    _, org = await _credential_change(request, session)
    provider_admin.delete_credential(rt, org, provider_id)
    return redirect(f"/console/providers/{provider_id}", request)


def _typed(schema: dict[str, Any], submitted: dict[str, str]) -> dict[str, Any]:
    """The submitted texts as the fields show them again (lines and JSON as typed)."""
    kinds = {f.name: f.kind for f in forms.fields(schema, {})}
    return {
        k: v.splitlines() if kinds.get(k) == "lines" else v
        for k, v in submitted.items()
        if kinds.get(k) != "json"
    }


@router.post("/providers/{provider_id}/check")
async def provider_check(
    request: Request, session: Session, provider_id: ProviderId, rt: ApiRuntime
) -> Response:
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    # As the api's check: the admin scope (it uses the org's stored credential).
    org = sessions.admin_org(session, form.get("org"))
    try:
        health = provider_admin.check_provider(rt, provider_id, org)
    except admin.AdminError as exc:
        raise HTTPException(status_code=404, detail="provider not found") from exc
    return page(
        "provider_check.html",
        session,
        provider_id=provider_id,
        org=org,
        health=health,
        compact=form.get("compact") == "1",  # a cell of the providers' table: the verdict
    )


# -- costs ---------------------------------------------------------------------------------


def _cost_query(
    session: ConsoleSession, org: str | None, since: str | None, by: str | None
) -> tuple[str | None, datetime, CostGrouping]:
    org_id = session.principal.org_filter(org or None)
    try:
        start = parse_since(since or "7d")
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from exc
    if by not in (None, "", *CostGrouping):
        raise HTTPException(status_code=422, detail=f"by: one of {', '.join(CostGrouping)}")
    grouping = CostGrouping(by) if by else CostGrouping.ORG
    return org_id, max(start, utcnow() - timedelta(days=400)), grouping


Text = Annotated[str | None, Query(max_length=128)]


@router.get("/costs")
def costs_page(
    session: Session, rt: ApiRuntime, org: Text = None, since: Text = None, by: Text = None
) -> Response:
    db = rt.db
    org_id, start, grouping = _cost_query(session, org, since, by)
    buckets = queries.cost_buckets(start)
    series = queries.cost_series(db, buckets, grouping, org_id)
    top = dict(sorted(series.items(), key=lambda kv: -sum(b["amount_micros"] for b in kv[1]))[:8])
    names = {}  # a pool by its org and name, not its id
    if grouping is CostGrouping.POOL:
        names = {p["id"]: f"{p['org']}/{p['name']}" for p in queries.pool_choices(db, org_id)}
    amounts = {names.get(k, k): [b["amount_micros"] / 1e6 for b in v] for k, v in top.items()}
    return page(
        "costs.html",
        session,
        nav="costs",
        table=views.cost_view(db, by=grouping, org_id=org_id, since=start),
        names=names,
        chart=charts.bar_chart(
            "spend per bucket",
            buckets.starts(),
            amounts,
            unit=f" {rt.settings.cost_unit}",
            chart_id="spend",
        ),
        unit=rt.settings.cost_unit,
        legend=[(k, charts.colour(i)) for i, k in enumerate(amounts)],
        filters={"org": org or "", "since": since or "7d", "by": grouping.value},
        groupings=[g.value for g in CostGrouping],
        budgets=_budget_rows(db, org_id),
    )


def _budget_rows(db: Database, org_id: str | None) -> list[dict[str, Any]]:
    """The budgets the page shows (the caller's org's, or ``org_id``'s, or all), money as the
    ledger prints it."""
    rows = budget_admin.list_budgets(db, org_id)
    for row in rows:
        row["spent"] = format_micros(row["spent_micros"])
        row["cap"] = format_micros(row["cap_micros"])
    return rows


@router.get("/costs.csv")
def costs_csv(
    session: Session, rt: ApiRuntime, org: Text = None, since: Text = None, by: Text = None
) -> Response:
    """Each bucket's spend per attribution key, as CSV."""
    org_id, start, grouping = _cost_query(session, org, since, by)
    buckets = queries.cost_buckets(start)
    series = queries.cost_series(rt.db, buckets, grouping, org_id)
    out = io.StringIO()
    writer = csv.writer(out)
    header = ["bucket_start", grouping.value, "events", "seconds", "amount_micros", "amount"]
    writer.writerow(header)
    for key, values in series.items():
        for at, bucket in zip(buckets.starts(), values, strict=True):
            if bucket["events"]:
                micros = bucket["amount_micros"]
                seconds = round(bucket["seconds"], 3)
                row = [at.isoformat(), key, bucket["events"], seconds, micros]
                writer.writerow([*row, format_micros(micros)])
    return Response(
        out.getvalue(),
        media_type="text/csv",
        headers={
            "Content-Disposition": 'attachment; filename="corral-costs.csv"',
            "Cache-Control": "no-store",
        },
    )
