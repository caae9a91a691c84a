"""The console's schema-generated forms and its SVG charts, piece by piece."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field, SecretStr

from corral.scheduler.api.console import cells, charts, forms
from corral.scheduler.api.console.queries import (
    Buckets,
    cost_buckets,
    dispatch_series,
    failure_series,
    last_hour,
)
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import WorkItem


class Example(BaseModel):
    api_key: SecretStr | None = None
    region: Literal["eu", "us"] = "eu"
    timeout_s: float = Field(default=5.0, description="how long")
    retries: int | None = None
    verbose: bool = False
    binds: list[str] = []
    labels: dict[str, str] = {}
    name: str = "x"


SCHEMA: dict[str, Any] = Example.model_json_schema()


def by_name(current: dict[str, Any]) -> dict[str, forms.Field]:
    return {f.name: f for f in forms.fields(SCHEMA, current)}


def test_each_property_gets_the_input_its_type_needs() -> None:
    fields = by_name({})
    kinds = {name: field.kind for name, field in fields.items()}
    assert kinds == {
        "api_key": "secret",
        "region": "choice",
        "timeout_s": "number",
        "retries": "integer",
        "verbose": "boolean",
        "binds": "lines",
        "labels": "json",
        "name": "text",
    }
    assert fields["region"].choices == ("eu", "us")
    assert fields["timeout_s"].placeholder == "default: 5.0"
    assert fields["timeout_s"].description == "how long"


def test_a_secret_is_never_filled_in_and_says_whether_one_is_stored() -> None:
    stored = by_name({"api_key": "sk-live-123", "binds": ["/a", "/b"], "labels": {"k": "v"}})
    assert stored["api_key"].value == ""
    assert stored["api_key"].placeholder == forms.SECRET_PLACEHOLDER
    assert "sk-live-123" not in repr(stored)
    assert by_name({})["api_key"].placeholder == "(not set)"
    assert stored["binds"].value == "/a\n/b"
    assert stored["labels"].value == '{\n  "k": "v"\n}'


def test_a_submitted_form_makes_the_configuration() -> None:
    form = {
        "f.api_key": "",
        "f.region": "us",
        "f.timeout_s": "2.5",
        "f.retries": "",
        "f.verbose": "true",
        "f.binds": "/a\n\n /b \n",
        "f.labels": '{"team": "ml"}',
        "f.name": "",
    }
    config = forms.document(SCHEMA, form, {"api_key": "kept-secret"})
    assert config == {
        "api_key": "kept-secret",  # left empty: the stored one stays
        "region": "us",
        "timeout_s": 2.5,
        "verbose": True,
        "binds": ["/a", "/b"],
        "labels": {"team": "ml"},
    }
    assert forms.document(SCHEMA, {"f.api_key": "new"}, {"api_key": "old"}) == {"api_key": "new"}
    assert forms.document(SCHEMA, {}, {}) == {}


def test_what_the_form_cannot_type_is_left_for_the_model_to_refuse() -> None:
    config = forms.document(SCHEMA, {"f.timeout_s": "soon", "f.retries": "2x"}, {})
    assert config == {"timeout_s": "soon", "retries": "2x"}
    with pytest.raises(forms.FormError, match=r"^labels: not valid JSON$"):
        forms.document(SCHEMA, {"f.labels": '{"secret-ish'}, {})


def test_a_chart_has_one_bar_segment_per_value_and_escapes_names() -> None:
    labels = [
        datetime(2026, 11, 23, 10, 0, tzinfo=UTC) + timedelta(minutes=5 * i) for i in range(3)
    ]
    svg = str(charts.bar_chart("t", labels, {"<a>": [1, 0, 2], "b": [0, 0, 3]}, chart_id="c"))
    assert svg.count("<rect") == 3 and "&lt;a&gt;: 2 at 2026-11-23 10:10 UTC" in svg
    assert "<a>" not in svg
    assert ">most 5 per bucket</text>" in svg  # the largest total above the bars
    assert str(charts.bar_chart("empty", [], {})).count("<rect") == 0


def test_a_chart_is_drawn_at_its_cards_width_so_its_text_is_not_scaled() -> None:
    labels = [datetime(2026, 11, 23, 10, 0, tzinfo=UTC) + timedelta(hours=i) for i in range(4)]
    svg = str(charts.bar_chart("spend", labels, {"a": [0.25, 0, 1234.5, 2]}, unit=" USD"))
    assert "viewBox" not in svg and 'width="100%"' in svg
    assert re.findall(r'<rect x="([0-9.]+)%"', svg) == ["1.500", "51.500", "76.500"]
    assert "most 1,234.50 USD per bucket" in svg and "a: 0.25 USD at 2026-11-23 10:00" in svg


def test_buckets_are_whole_multiples_of_their_width_the_last_holding_now() -> None:
    now = datetime(2026, 11, 23, 10, 7, 31, tzinfo=UTC)
    hour = last_hour(now)
    assert hour.end == datetime(2026, 11, 23, 10, 10, tzinfo=UTC)
    assert hour.start == datetime(2026, 11, 23, 9, 10, tzinfo=UTC)
    assert len(hour.starts()) == 12 and hour.start <= now - timedelta(minutes=55)
    week = cost_buckets(now - timedelta(days=7), now)
    assert (week.width, week.count) == (timedelta(days=1), 8)  # the first holds since
    assert week.end == datetime(2026, 11, 24, tzinfo=UTC)
    day = cost_buckets(now - timedelta(hours=24), now)
    assert (day.width, day.count) == (timedelta(hours=1), 25)
    assert Buckets.up_to(now, timedelta(hours=1), 1).start == datetime(2026, 11, 23, 10, tzinfo=UTC)


def test_time_buckets_count_the_same_rows_on_sqlite(sqlite_db: Database) -> None:
    """The embedded default (`corral dev`) buckets timestamps with SQLite's own functions."""
    now = utcnow()
    hour = last_hour(now)
    ages = [timedelta(seconds=1), timedelta(minutes=7), timedelta(minutes=59), timedelta(hours=2)]
    with sqlite_db.session() as session:
        for number, age in enumerate(ages):
            session.add(
                WorkItem(
                    id=f"wi-{number}",
                    org_id="acme" if number else "other",
                    project_id="web",
                    payload={},
                    state="failed" if number == 1 else "succeeded",
                    created_at=now - age,
                    updated_at=now - age,
                )
            )
    expected = [0] * 12
    for age in ages:
        if now - age >= hour.start:  # 59 minutes ago may be before the first bucket
            expected[int(((now - age) - hour.start) / hour.width)] += 1
    assert dispatch_series(sqlite_db, hour, None) == expected
    assert sum(dispatch_series(sqlite_db, hour, "acme")) == sum(expected) - 1
    assert sum(failure_series(sqlite_db, hour, None)) == 1


def test_a_capability_cell_is_words_never_json_nor_python_values() -> None:
    assert cells.cell("supports_gpu", True) == "\N{CHECK MARK}"
    assert cells.cell("supports_gpu", False) == "\N{EN DASH}"
    assert cells.cell("max_vcpu", None) == "no limit"
    assert cells.cell("egress_default", None) == "\N{EN DASH}"
    assert cells.cell("max_session_duration_seconds", 18000) == "18,000 s"
    assert cells.cell("backoff_s", 2.5) == "2.5 s"
    assert cells.cell("regions", ["*"]) == "any"
    assert cells.cell("gpu_types", []) == "none"
    assert cells.cell("os", ["linux", "darwin"]) == "linux, darwin"
    flat = cells.flat({"arch": ["x86_64"], "substrate": {"runtime_kinds": ["native"]}})
    assert flat == {"arch": ["x86_64"], "substrate.runtime_kinds": ["native"]}
    assert cells.label("substrate.runtime_kinds") == "substrate: runtime kinds"
    assert cells.rate("active-cpu", 1_500_000, "USD") == "1.500000 USD a CPU second"


def test_a_form_of_several_generated_parts_keeps_each_parts_names_apart() -> None:
    lease = forms.fields(SCHEMA, {"retries": 2}, prefix="lease")
    assert {f.prefix for f in lease} == {"lease"}
    form = {"lease.retries": "3", "f.retries": "9"}
    assert forms.document(SCHEMA, form, {}, prefix="lease") == {"retries": 3}
    assert forms.submitted(form, "lease") == {"retries": "3"}
