"""``corral capacities``, ``corral pools --capacity`` and ``corral orgs weight`` against the
embedded database: a capacity created, listed, shown, changed and deleted (refused while a
pool draws on it); pools put on it and taken off it under its rules; an org's weight set,
shown and reset; ``corral status`` showing the division."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.test_cli_operator import embedded, run, setup_pool

__all__ = ["embedded"]  # the autouse fixture: an embedded database of the test's own


def _pool(org: str, name: str, *options: str) -> dict[str, str]:
    made = run("pools", "create", "--org", org, "--name", name, "--provider", "local", *options)
    return dict(json.loads(made.stdout))


def test_a_capacity_is_created_listed_shown_changed_and_deleted(embedded: Path) -> None:
    made = run("capacities", "create", "gpu-host", "--slots", "8").stdout
    assert made.startswith("capacity gpu-host (cap-") and "8 slots, 0 in use" in made
    assert "no pools draw on it" in made
    [row] = json.loads(run("capacities", "list", "--format", "json").stdout)
    assert (row["name"], row["slots"], row["pools"]) == ("gpu-host", 8, [])
    listed = run("capacities", "list").stdout.splitlines()
    assert listed[0].split() == ["capacity", "slots", "pools", "id"]
    assert listed[1].split()[:3] == ["gpu-host", "0/8", "-"]
    assert "4 slots" in run("capacities", "set", "gpu-host", "--slots", "4").stdout
    assert json.loads(run("capacities", "show", row["id"], "--format", "json").stdout)["slots"] == 4
    refused = run("capacities", "set", "gpu-host", "--slots", "0", code=2)
    assert "slots" in refused.output
    taken = run("capacities", "create", "gpu-host", "--slots", "1", code=2)
    assert "another capacity has that name" in taken.output
    assert run("capacities", "delete", "gpu-host").stdout.strip() == "capacity gpu-host deleted"
    assert "no such capacity" in run("capacities", "show", "gpu-host", code=2).output
    assert run("capacities", "list").stdout.strip() == "no capacities"


def test_pools_are_put_on_a_capacity_under_its_rules_and_shown_with_it(embedded: Path) -> None:
    setup_pool("acme")
    run("capacities", "create", "shared", "--slots", "6")
    linked = json.loads(
        run("pools", "update", "local", "--org", "acme", "--capacity", "shared").stdout
    )
    assert (linked["capacity"], linked["share_limit"]) == ("shared", 0)
    other = _pool("acme", "other")
    update_other = ["pools", "update", "other", "--org", "acme"]
    refused = run(*update_other, "--capacity", "shared", code=2)
    assert "capacity: the org's pool local draws on that capacity already" in refused.output
    beta = _pool("beta", "local", "--capacity", "shared")
    assert beta["capacity"] == "shared"
    warm_pool = ["--org", "gamma", "--name", "warm", "--provider", "local", "--warm-min", "1"]
    warm = run("pools", "create", *warm_pool, "--capacity", "shared", code=2)
    assert "capacity: a pool with warm sandboxes" in warm.output
    on_warm = run("pools", "update", "local", "--org", "acme", "--warm-min", "1", code=2)
    assert "warm_min: a pool on a shared capacity" in on_warm.output
    unknown = run(*update_other, "--capacity", "nope", code=2)
    assert "no shared capacity of that name" in unknown.output
    both = run(*update_other, "--capacity", "shared", "--no-capacity", code=2)
    assert "give one of them" in both.output
    table = run("pools", "list", "--org", "acme").stdout.splitlines()
    assert table[0].split()[-2:] == ["capacity", "id"]
    assert [line.split()[-2] for line in table[1:]] == ["shared", "-"]
    assert other["capacity"] is None
    shown = run("capacities", "show", "shared").stdout
    assert [line.split()[:2] for line in shown.splitlines()[2:]] == [
        ["acme", "local"],
        ["beta", "local"],
    ]
    refused = run("capacities", "delete", "shared", code=2)
    assert "acme/local, beta/local" in refused.output and "--no-capacity" in refused.output
    for org in ("acme", "beta"):
        off = json.loads(run("pools", "update", "local", "--org", org, "--no-capacity").stdout)
        # Closed to arrivals (a share of the slots it holds, none) until the re-drive.
        assert (off["capacity"], off["share_limit"]) == (None, 0)
    run("capacities", "delete", "shared")


def test_an_orgs_weight_is_shown_set_reset_and_checked(embedded: Path) -> None:
    assert run("orgs", "weight", "acme").stdout.strip() == "org acme: weight 1 (the default)"
    assert run("orgs", "weight", "acme", "3").stdout.strip() == "org acme: weight 3"
    assert run("orgs", "weight", "acme").stdout.strip() == "org acme: weight 3"
    assert "between 1 and 1000" in run("orgs", "weight", "acme", "0", code=2).output
    assert "not both" in run("orgs", "weight", "acme", "2", "--reset", code=2).output
    reset = run("orgs", "weight", "acme", "--reset").stdout.strip()
    assert reset == "org acme: weight 1 (the default)"


def test_status_shows_each_capacity_with_its_orgs_weights_and_shares(embedded: Path) -> None:
    setup_pool("acme")
    run("capacities", "create", "shared", "--slots", "6")
    run("capacities", "create", "idle", "--slots", "2")
    run("pools", "update", "local", "--org", "acme", "--capacity", "shared")
    run("orgs", "weight", "acme", "3")
    text = run("status", code=0).stdout.splitlines()
    start = text.index("shared capacities")
    header, *rows = (line.split() for line in text[start + 1 : start + 4])
    assert header[-7:] == ["org", "pool", "weight", "held", "share", "waiting", "state"]
    assert rows == [
        ["idle", "(0/2)", "-", "-", "-", "-", "-", "-", "-"],
        ["shared", "(0/6)", "acme", "local", "3", "0", "0", "0", "active"],
    ]
    document = json.loads(run("status", "--format", "json").stdout)
    [shared] = [c for c in document["capacities"] if c["name"] == "shared"]
    assert shared["pools"][0]["weight"] == 3 and shared["pools"][0]["share_limit"] == 0
