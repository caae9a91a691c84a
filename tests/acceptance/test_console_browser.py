"""The web console in a real browser (Debian's headless Chromium, driven through Debian's
chromedriver by Selenium) against a running stack after real dispatches: log in (the login
form's CSRF token, the session cookie's flags), the overview's numbers against the
database, an item's events and log lines (followed live while it runs), a pool disabled and
enabled again, a provider setting refused and then saved through the generated form, test
connection, an org's credential stored (write-only), a running item cancelled, a pool's
lease and warm fields and its deletion, and logging out, after which the session's cookie,
put back, opens nothing.

The browser is 1,280 px wide, and no page may scroll sideways; the charts' labels are at
least 11 px tall as the browser computes them, and the overview shows which processes
consume which queue. Screenshots of every page land in ``test-artifacts/console/`` at the
repository root; the page source of every page is scanned for tokens, credentials and
dispatch env values.
"""

from __future__ import annotations

import re
import shutil
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import Engine, func, select

from corral.scheduler.api.console.queries import last_hour
from corral.shared.store.db import Database
from corral.shared.store.ledger import format_micros
from corral.shared.store.models import CostEvent, Pool, WorkItem
from tests.acceptance.conftest import shell
from tests.acceptance.stack import REPO, Stack
from tests.conftest import _database, _url, require, require_bwrap_path

ORG = "console-org"
SECRET = "DISPATCH_SECRET_console_5f1c"  # a dispatch env value: never on a page
CREDENTIAL = "stored-credential-console-9d2e"  # an org's stored credential: never on a page
ARTIFACTS = REPO / "test-artifacts" / "console"
RATE = {"rate_micros": 250_000}  # 0.25 a sandbox session (local bills fixed): spend to chart
WIDTH = 1280  # the narrowest screen the console is laid out for
SMALLEST_TEXT_PX = 11.0
LONG = "for i in $(seq 1 600); do echo tick $i; sleep 0.3; done"


@pytest.fixture(scope="module")
def stack(postgres_engine: Engine, postgres_template: str, redis_url: str) -> Iterator[Stack]:
    """A stack on a database of this module's own: the test stores a provider's settings
    (sealed with its stack's key), which no other test's stack could open."""
    require_bwrap_path()
    with _database(postgres_engine, "corral_c_", postgres_template) as name:
        running = Stack(database_url=_url(name), broker_url=redis_url)
        try:
            running.start()
            yield running
        finally:
            running.stop()


@pytest.fixture(scope="module")
def items(stack: Stack) -> dict[str, str]:
    """Org console-org with a local pool, and real dispatches: two that succeed (one with a
    secret env value), one that fails, and one that runs until it is cancelled."""
    stack.make_org(ORG)
    [pool] = stack.request("GET", f"/v1/admin/pools?org={ORG}")[1]["pools"]
    status, answer = stack.request("PATCH", f"/v1/admin/pools/{pool['id']}", RATE)
    assert status == 200, answer
    bodies = {
        "hello": shell(ORG, "echo hello from the console test; echo second line"),
        "secret": shell(ORG, "echo token is set", env={"API_TOKEN": SECRET}),
        "failing": shell(ORG, "echo about to fail; exit 3"),
        # No pool of the org provides a GPU: a dispatch error, which never had a sandbox.
        "refused": shell(ORG, "nvidia-smi", agent_card={"requires": [{"kind": "gpu"}]}),
    }
    ids = {}
    for name, body in bodies.items():
        status, answer = stack.request("POST", "/v1/dispatch", body)
        assert status == 202, answer
        ids[name] = answer["id"]
    views = stack.wait_final(list(ids.values()))
    states = [v["state"] for v in views]
    assert states == ["succeeded", "succeeded", "failed", "dispatch_error"], views
    status, answer = stack.request("POST", "/v1/dispatch", shell(ORG, LONG))
    assert status == 202, answer
    ids["long"] = answer["id"]
    stack.until(
        lambda: stack.request("GET", f"/v1/work-items/{ids['long']}")[1]["state"] == "running",
        "the long item does not run",
        timeout_s=60,
    )
    return ids


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    require(shutil.which("chromium") is not None, "Debian's chromium")
    require(shutil.which("chromedriver") is not None, "Debian's chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={WIDTH},1000")
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
    service = Service(executable_path=shutil.which("chromedriver") or "")
    driver = webdriver.Chrome(options=options, service=service)
    driver.implicitly_wait(0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


SOURCES: dict[str, str] = {}  # every page's source as the browser had it, for the scan


def wait(driver: WebDriver, condition: Any, timeout_s: float = 20) -> Any:
    """``condition()``'s first true value; an element that went stale while it was read (a
    page being replaced) counts as not yet."""
    waiting = WebDriverWait(
        driver, timeout_s, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    )
    return waiting.until(lambda _: condition())


def shot(driver: WebDriver, name: str) -> None:
    """Keep the page's source and a screenshot; the page must not scroll sideways."""
    SOURCES[name] = driver.page_source
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 0
    assert_fits(driver, name)


def assert_fits(driver: WebDriver, name: str) -> None:
    """Nothing on the page is wider than the window: it does not scroll sideways."""
    width, client = driver.execute_script(
        "const e = document.scrollingElement; return [e.scrollWidth, e.clientWidth]"
    )
    assert client <= WIDTH and width <= client, f"the {name} page is {width} px wide in {client}"


def chart_text_sizes(driver: WebDriver, chart_id: str) -> list[float]:
    """The computed font size (px) of every label of the chart ``chart_id``."""
    sizes = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(t => parseFloat(getComputedStyle(t).fontSize))",
        f"svg#{chart_id} text",
    )
    return [float(size) for size in sizes]


def text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def assert_strict(cookie: dict[str, Any] | None, path: str) -> None:
    """Secure (the stack speaks plain http on 127.0.0.1: Chromium keeps a Secure cookie
    from loopback), HttpOnly, SameSite=Strict, on ``path``."""
    assert cookie is not None
    flags = (cookie["secure"], cookie["httpOnly"], cookie["sameSite"], cookie["path"])
    assert flags == (True, True, "Strict", path), cookie


def log_in(browser: WebDriver, token: str) -> None:
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "login").click()


def test_log_in(stack: Stack, browser: WebDriver, items: dict[str, str]) -> None:
    browser.get(f"{stack.api_url}/console/overview")
    wait(browser, lambda: browser.current_url.endswith("/console/login"))
    shot(browser, "login")
    # The form's CSRF token is the HMAC of the nonce its cookie holds, not the nonce.
    csrf = browser.find_element(By.ID, "login-csrf").get_attribute("value") or ""
    nonce = browser.get_cookie("corral_console_login")
    assert_strict(nonce, "/console/login")
    assert re.fullmatch(r"[0-9a-f]{64}", csrf) and nonce is not None and nonce["value"] != csrf
    # Without it (a form another site made), the right token logs nobody in.
    browser.execute_script("document.getElementById('login-csrf').remove()")
    log_in(browser, stack.admin_token)
    wait(browser, lambda: browser.find_elements(By.ID, "error-detail"))
    assert "reload the login page" in text(browser, "h1")
    assert browser.get_cookie("corral_console") is None
    browser.get(f"{stack.api_url}/console/login")
    log_in(browser, "not-the-token")
    wait(browser, lambda: browser.find_elements(By.ID, "login-error"))
    log_in(browser, stack.admin_token)
    wait(browser, lambda: browser.current_url.endswith("/console/overview"))
    assert text(browser, "#who") == "deployment admin"
    cookie = browser.get_cookie("corral_console")
    assert_strict(cookie, "/console")
    assert cookie is not None and re.fullmatch(r"[A-Za-z0-9_-]{43}", cookie["value"])


def database_numbers(db: Database, since: datetime) -> dict[str, Any]:
    """Items by state, items created since ``since``, and the org's pool's slots in use."""
    with db.session() as session:
        counts = dict(
            session.execute(select(WorkItem.state, func.count()).group_by(WorkItem.state)).all()
        )
        recent = session.scalar(
            select(func.count()).select_from(WorkItem).where(WorkItem.created_at >= since)
        )
        slots = session.scalars(select(Pool.slots_in_use).where(Pool.org_id == ORG)).one()
    return {"states": counts, "recent": recent, "slots": slots}


def test_the_overview_shows_the_databases_numbers(
    stack: Stack, browser: WebDriver, items: dict[str, str], db: Database
) -> None:
    while True:  # numbers that held while the page was made (the session's database is
        # shared: this stack's reaper may still end another module's leftovers)
        hour = last_hour()
        before = database_numbers(db, hour.start)
        browser.get(f"{stack.api_url}/console/overview")
        numbers = database_numbers(db, hour.start)
        if numbers == before and last_hour() == hour:
            break
    counts, slots = numbers["states"], numbers["slots"]
    shown = {
        e.get_attribute("id").removeprefix("state-"): int(e.text)
        for e in browser.find_elements(By.CSS_SELECTOR, "#states td[id^=state-]")
    }
    assert shown == counts
    assert int(text(browser, "#dispatched-hour")) == numbers["recent"]
    assert int(text(browser, "#failed-hour")) >= 1
    pool_row = text(browser, "#pools tbody")
    assert ORG in pool_row and "closed" in pool_row and f"{slots} / " in pool_row
    assert slots == 1  # the long item's
    assert browser.find_elements(By.CSS_SELECTOR, "svg#rate rect")  # the chart has bars
    # The charts are drawn at their card's width, their labels readable at 100 %.
    for chart in ("rate", "failures"):
        sizes = chart_text_sizes(browser, chart)
        assert sizes and min(sizes) >= SMALLEST_TEXT_PX, (chart, sizes)
        svg = browser.find_element(By.CSS_SELECTOR, f"svg#{chart}")
        card = svg.find_element(
            By.XPATH, "./ancestor::div[contains(concat(' ', @class, ' '), ' card ')]"
        )
        assert svg.size["width"] >= card.size["width"] * 0.85, (svg.size, card.size)
    # The processes that consume each queue, as corral status shows them.
    queues = {
        row.get_attribute("id").removeprefix("queue-"): row.text
        for row in browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr[id^=queue-]")
    }
    assert {"dispatch", "maintenance", "provision.local"} <= set(queues), queues
    assert "consumed" in queues["provision.local"] and "consumed" in queues["dispatch"]
    processes = text(browser, "#processes")
    assert "worker-local@" in processes and "maintenance@" in processes, processes
    shot(browser, "overview")


def test_an_item_page_shows_its_events_and_log_lines(
    stack: Stack, browser: WebDriver, items: dict[str, str]
) -> None:
    browser.get(f"{stack.api_url}/console/items?org={ORG}")
    assert items["hello"] in text(browser, "#items")
    shot(browser, "items")
    browser.find_element(By.LINK_TEXT, items["hello"]).click()
    wait(browser, lambda: text(browser, "#item-state") == "succeeded")
    events = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#events li .to")]
    assert events[0] == "received", events
    assert {"routed", "running", "succeeded"} <= set(events), events
    log = text(browser, "#log-lines")
    assert "hello from the console test" in log and "second line" in log
    assert "local" in text(browser, "#sandboxes")
    shot(browser, "item")
    browser.get(f"{stack.api_url}/console/items/{items['secret']}")
    assert "token is set" in text(browser, "#log-lines")
    shot(browser, "item-secret-env")


def test_a_running_items_log_follows_and_it_is_cancelled(
    stack: Stack, browser: WebDriver, items: dict[str, str], db: Database
) -> None:
    browser.get(f"{stack.api_url}/console/items/{items['long']}")
    assert text(browser, "#item-state") == "running"

    def ticks() -> int:
        found = re.findall(r"tick (\d+)", text(browser, "#log-lines"))
        return int(found[-1]) if found else 0

    first = ticks()
    wait(browser, lambda: ticks() >= first + 3)  # new lines arrive without a reload
    shot(browser, "item-running")
    browser.find_element(By.ID, "cancel").click()
    wait(browser, lambda: text(browser, "#item-state") == "cancelled")
    with db.session() as session:
        item = session.get(WorkItem, items["long"])
        assert item is not None and item.state == "cancelled"
    shot(browser, "item-cancelled")


def test_an_item_refused_at_dispatch_shows_no_panel_that_cannot_fill(
    stack: Stack, browser: WebDriver, items: dict[str, str]
) -> None:
    browser.get(f"{stack.api_url}/console/items/{items['refused']}")
    assert text(browser, "#item-state") == "dispatch_error"
    assert "no_eligible_pool" in text(browser, "#item-error")
    for panel in ("sandboxes", "log-lines", "result"):
        assert browser.find_elements(By.ID, panel) == [], panel
    shot(browser, "item-dispatch-error")


def test_a_pool_is_disabled_and_enabled_again(
    stack: Stack, browser: WebDriver, items: dict[str, str], db: Database
) -> None:
    browser.get(f"{stack.api_url}/console/pools")
    shot(browser, "pools")
    browser.find_element(By.CSS_SELECTOR, "#pools a[href^='/console/pools/pool-']").click()
    wait(browser, lambda: browser.find_elements(By.ID, "toggle-active"))
    pool_id = browser.current_url.rsplit("/", 1)[1]
    for expected in ("disabled", "enabled"):
        browser.find_element(By.ID, "toggle-active").click()
        wait(browser, lambda e=expected: text(browser, "#pool-active") == e)
        with db.session() as session:
            pool = session.get(Pool, pool_id)
            assert pool is not None and pool.active is (expected == "enabled")
        shot(browser, f"pool-{expected}")


def test_a_pools_form_has_its_lease_and_warm_fields_and_the_pool_is_deleted(
    stack: Stack, browser: WebDriver, items: dict[str, str], db: Database
) -> None:
    spare = {"org_id": ORG, "name": "spare", "provider_id": "local", "priority": -1}
    status, pool = stack.request("POST", "/v1/admin/pools", spare)
    assert status == 201, pool
    browser.get(f"{stack.api_url}/console/pools/{pool['id']}")
    for field in ("lease-max_attempts", "lease-on_heartbeat_lost", "warm_min", "warm_schedule"):
        assert browser.find_elements(By.ID, field), field
    browser.find_element(By.ID, "lease-max_attempts").send_keys("2")
    browser.find_element(By.ID, "save-pool").click()
    wait(browser, lambda: "max attempts: 2" in text(browser, "#pool-lease"))
    assert "a sandbox session" in text(browser, "#pool-rate")  # the rate with its unit
    shot(browser, "pool")
    browser.find_element(By.ID, "pool-items").click()
    wait(browser, lambda: "/console/items?pool=" in browser.current_url)
    browser.get(f"{stack.api_url}/console/pools/{pool['id']}")
    browser.find_element(By.ID, "delete-pool").click()
    wait(browser, lambda: browser.find_elements(By.ID, "confirm-delete"))
    shot(browser, "pool-delete")
    browser.find_element(By.ID, "confirm-delete").click()
    wait(browser, lambda: browser.current_url.endswith("/console/pools"))
    with db.session() as session:
        deleted = session.get(Pool, pool["id"])
        assert deleted is not None and deleted.deleted_at is not None
    assert "spare" not in text(browser, "#pools")


def test_the_other_pages_fit_the_window(
    stack: Stack, browser: WebDriver, items: dict[str, str]
) -> None:
    for name in ("webhooks", "secrets"):
        browser.get(f"{stack.api_url}/console/{name}")
        shot(browser, name)


def test_the_overview_refreshes_itself(
    stack: Stack, browser: WebDriver, items: dict[str, str]
) -> None:
    browser.get(f"{stack.api_url}/console/overview")
    [pool] = stack.request("GET", f"/v1/admin/pools?org={ORG}")[1]["pools"]
    row = f"#pool-{pool['id']} .active"
    assert text(browser, row) == "enabled"
    path = f"/v1/admin/pools/{pool['id']}"
    assert stack.request("PATCH", path, {"active": False})[0] == 200
    try:  # htmx reloads the numbers every 10 s, with no page load
        wait(browser, lambda: text(browser, row) == "disabled", timeout_s=25)
    finally:
        assert stack.request("PATCH", path, {"active": True})[0] == 200


def test_a_provider_setting_is_refused_then_saved_and_the_connection_tested(
    stack: Stack, browser: WebDriver, items: dict[str, str]
) -> None:
    browser.get(f"{stack.api_url}/console/providers")
    assert "local" in text(browser, "#providers")
    browser.find_element(By.CSS_SELECTOR, "#health-local button").click()
    wait(browser, lambda: "healthy" in text(browser, "#health-local"))
    shot(browser, "providers")
    browser.get(f"{stack.api_url}/console/providers/local")
    grace = browser.find_element(By.ID, "f-grace_period_s")
    grace.clear()
    grace.send_keys("soon")
    browser.find_element(By.ID, "save-config").click()
    wait(browser, lambda: browser.find_elements(By.ID, "form-error"))
    assert "grace_period_s" in text(browser, "#form-error")
    shot(browser, "provider-invalid")
    grace = browser.find_element(By.ID, "f-grace_period_s")
    grace.clear()
    grace.send_keys("2")
    browser.find_element(By.ID, "save-config").click()
    wait(browser, lambda: browser.find_elements(By.ID, "saved"))
    assert text(browser, "#config-source") == "stored"
    status, document = stack.request("GET", "/v1/admin/providers/local/config")
    assert status == 200 and document["config"]["grace_period_s"] == 2
    assert document["config"]["root_dir"] == str(stack.sandbox_root)  # kept as it was set
    browser.find_element(By.ID, "check-org").send_keys(ORG)
    browser.find_element(By.ID, "check").click()
    wait(browser, lambda: "healthy" in text(browser, "#check-result"))
    assert f"org {ORG}" in text(browser, "#check-result")
    shot(browser, "provider")
    browser.find_element(By.ID, "credential-org").send_keys(ORG)
    browser.find_element(By.ID, "credential-secret").send_keys(CREDENTIAL)
    browser.find_element(By.ID, "store-credential").click()
    wait(browser, lambda: browser.find_elements(By.ID, f"credential-{ORG}"))
    status, answer = stack.request("GET", f"/v1/admin/orgs/{ORG}/credentials")
    assert status == 200 and [c["provider"] for c in answer["credentials"]] == ["local"]
    shot(browser, "provider-credential")


def test_the_costs_page_charts_and_totals_the_ledger(
    stack: Stack, browser: WebDriver, items: dict[str, str], db: Database
) -> None:
    def billed() -> int:
        with db.session() as session:
            query = select(func.count()).select_from(CostEvent).where(CostEvent.org_id == ORG)
            return session.scalar(query) or 0

    # Every item of the org has ended (the long one cancelled): one cost event each that had
    # a sandbox (not the one refused at dispatch), after which the org's spend stays.
    ran = [name for name in items if name != "refused"]
    stack.until(lambda: billed() == len(ran), "the org's sandboxes were not billed")
    browser.get(f"{stack.api_url}/console/costs?since=24h&by=pool&org={ORG}")
    with db.session() as session:
        total = session.scalar(
            select(func.sum(CostEvent.amount_micros)).where(CostEvent.org_id == ORG)
        )
    assert total and text(browser, "#cost-total") == format_micros(int(total))
    assert f"{ORG}/local" in text(browser, "#cost-table")  # the pool by its name
    assert browser.find_elements(By.CSS_SELECTOR, "svg#spend rect")  # bars
    sizes = chart_text_sizes(browser, "spend")
    assert sizes and min(sizes) >= SMALLEST_TEXT_PX, sizes
    csv = browser.find_element(By.ID, "csv").get_attribute("href") or ""
    assert "/console/costs.csv?" in csv and f"org={ORG}" in csv
    shot(browser, "costs")


def test_no_page_source_holds_a_token_a_credential_or_an_env_value(
    stack: Stack, browser: WebDriver, items: dict[str, str]
) -> None:
    assert len(SOURCES) >= 12, sorted(SOURCES)
    cookie = browser.get_cookie("corral_console")
    assert cookie is not None
    for path in ("overview", "items", "pools", "providers", "providers/local", "costs"):
        SOURCES[f"raw {path}"] = raw_page(stack, f"/console/{path}", cookie["value"])
    for item_id in items.values():
        SOURCES[f"raw {item_id}"] = raw_page(stack, f"/console/items/{item_id}", cookie["value"])
    for name, source in SOURCES.items():
        for needle in ("crt_", "crs_", stack.admin_token, SECRET, CREDENTIAL):
            assert needle not in source, f"{needle[:5]}… in the {name} page"
        assert "http://" not in source.replace(stack.api_url, ""), name  # nothing from outside


def test_logging_out_ends_the_session_server_side(stack: Stack, browser: WebDriver) -> None:
    browser.get(f"{stack.api_url}/console/overview")
    saved = browser.get_cookie("corral_console")
    assert saved is not None
    browser.find_element(By.ID, "logout").click()
    wait(browser, lambda: browser.current_url.endswith("/console/login"))
    assert browser.get_cookie("corral_console") is None
    # The cookie put back, as a copy of it would be: the server revoked its session.
    browser.add_cookie({k: saved[k] for k in ("name", "value", "path", "secure", "httpOnly")})
    assert browser.get_cookie("corral_console") is not None
    browser.get(f"{stack.api_url}/console/overview")
    wait(browser, lambda: browser.current_url.endswith("/console/login"))
    assert browser.find_elements(By.ID, "login-form")
    # Not even through a client of its own (urllib follows the redirect to the form).
    assert 'id="login-form"' in raw_page(stack, "/console/overview", saved["value"])
    shot(browser, "logged-out")


def test_the_pages_scripts_ran_without_errors(browser: WebDriver) -> None:
    """No script error and nothing the Content-Security-Policy blocked (htmx included)."""
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    # The refused token (401), the login form without its token (403) and the refused
    # setting (422) are answers the browser reports.
    answered = re.compile(r"Failed to load resource: .* status of (401|403|422) ")
    assert [e for e in errors if not answered.search(e)] == []


def raw_page(stack: Stack, path: str, cookie: str) -> str:
    request = urllib.request.Request(stack.api_url + path)
    request.add_header("Cookie", f"corral_console={cookie}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200, path
        return str(answer.read().decode())


def test_screenshots_were_written() -> None:
    names = {path.stem for path in Path(ARTIFACTS).glob("*.png")}
    assert {"login", "overview", "items", "item", "pools", "pool", "provider", "costs"} <= names
