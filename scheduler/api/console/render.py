"""Templates, static files, and the small helpers every console page uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from corral.scheduler.api.console import cells
from corral.scheduler.api.console.session import ConsoleSession
from corral.shared.store import estimates

HERE = Path(__file__).parent
STATIC = {
    "htmx.min.js": "text/javascript",
    "console.css": "text/css",
    "htmx.LICENSE": "text/plain",
}

templates = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["query"] = lambda params: urlencode({k: v for k, v in params.items() if v})
# A pool's or provider's capabilities as (label, cell) rows: no JSON, no Python literals.
templates.filters["capability_rows"] = lambda capabilities: [
    (cells.label(name), cells.cell(name, value)) for name, value in cells.flat(capabilities).items()
]

# A waiting item's estimated start in words, as ``corral show`` says it.
templates.filters["start_said"] = estimates.said

# A page that names no-store is never cached: it may show an org's rows.
NO_STORE = {"Cache-Control": "no-store", "X-Frame-Options": "DENY"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def page(
    name: str, session: ConsoleSession | None, *, status: int = 200, **context: Any
) -> HTMLResponse:
    """The template ``name`` rendered, with the caller and its CSRF nonce."""
    html = templates.get_template(name).render(
        session=session,
        principal=session.principal if session else None,
        csrf=session.csrf if session else "",
        **context,
    )
    headers = {**NO_STORE, "Content-Security-Policy": CSP}
    return HTMLResponse(html, status_code=status, headers=headers)


def redirect(url: str, request: Request) -> Response:
    """To ``url``: a 303, or for htmx an ``HX-Redirect``."""
    if request.headers.get("hx-request"):
        return Response(status_code=204, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


async def read_form(request: Request) -> dict[str, str]:
    """A url-encoded form body (the last value of a repeated name)."""
    body = (await request.body()).decode(errors="replace")
    return dict(parse_qsl(body, keep_blank_values=True))


def static_file(name: str) -> Response:
    """One of the console's static files, cached for an hour."""
    kind = STATIC.get(name)
    if kind is None:
        return Response(status_code=404)
    return Response(
        (HERE / "static" / name).read_bytes(),
        media_type=kind,
        headers={"Cache-Control": "public, max-age=3600"},
    )
