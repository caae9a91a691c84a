"""`corral providers demo`, the local provider's tour, on real bubblewrap: every case ends as
it should, and the network cases show the boundary (the outside reached through the egress
proxy, the host's own services refused, nothing without network)."""

from __future__ import annotations

from corral.providers.local.demo import run_demo


def test_the_tour_ends_as_expected_and_shows_the_network_boundary(require_bwrap: str) -> None:
    lines: list[str] = []
    assert run_demo(lines.append), "\n".join(lines)
    allowed = next(line for line in lines if line.startswith("network allowed"))
    cut = next(line for line in lines if line.startswith("network cut"))
    assert "127.0.0.2: reached" in allowed and "127.0.0.1: refused" in allowed, allowed
    assert "127.0.0.2: no network" in cut and "127.0.0.1: no network" in cut, cut
