"""The runner keeps trying a control plane that is away (an api restart, a database
outage) until its retry budget runs out, not for a fixed handful of attempts."""

from __future__ import annotations

import time

import pytest

from corral.runner.control import ControlClient, Endpoint
from corral.runner.errors import ControlError
from tests.unit.test_runner import TOKEN, PlaneFactory, control_plane, shell

__all__ = ["control_plane"]  # the fixture, used by name


def test_register_goes_through_after_forty_failed_calls(control_plane: PlaneFactory) -> None:
    plane = control_plane(shell("true"), register_failures=[503] * 40)
    client = ControlClient(
        Endpoint.parse(plane.url), backoff_s=0.005, backoff_max_s=0.02, retry_budget_s=60
    )
    registration = client.register(TOKEN)
    assert registration.work_item_id == "wi-test"
    assert plane.paths().count("/v1/runner/register") == 41


def test_a_control_plane_away_past_the_budget_is_an_error(control_plane: PlaneFactory) -> None:
    plane = control_plane(shell("true"), register_failures=[503] * 10_000)
    client = ControlClient(
        Endpoint.parse(plane.url), backoff_s=0.01, backoff_max_s=0.05, retry_budget_s=0.5
    )
    started = time.monotonic()
    with pytest.raises(ControlError):
        client.register(TOKEN)
    assert 0.4 <= time.monotonic() - started < 5
    assert plane.paths().count("/v1/runner/register") > 5


def test_a_refusal_is_not_retried(control_plane: PlaneFactory) -> None:
    plane = control_plane(shell("true"))
    client = ControlClient(Endpoint.parse(plane.url), retry_budget_s=60)
    with pytest.raises(ControlError):
        client.register("crt_wrong")
    assert plane.paths().count("/v1/runner/register") == 1
