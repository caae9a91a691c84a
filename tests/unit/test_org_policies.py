"""An org's policy: image references read as an engine reads them, patterns on the full
reference, regions, and the deployment's default for what the org has not set."""

from __future__ import annotations

import pytest

from corral.shared.store.org_policies import Policy, check_patterns, effective, full_reference


@pytest.mark.parametrize(
    ("reference", "full"),
    [
        ("ubuntu", "docker.io/library/ubuntu"),
        ("ubuntu:24.04", "docker.io/library/ubuntu:24.04"),
        ("acme/app:1", "docker.io/acme/app:1"),
        ("registry.example.com/acme/app:1", "registry.example.com/acme/app:1"),
        ("localhost:5000/app", "localhost:5000/app"),
        ("ghcr.io/o/r@sha256:" + "a" * 64, "ghcr.io/o/r@sha256:" + "a" * 64),
        ("Ubuntu", None),  # a name is lower case
        ("a/../b", None),
        ("ubuntu latest", None),
        ("registry.example.com/acme/app:1\n", None),
        ("", None),
    ],
)
def test_a_reference_is_read_as_an_engine_reads_it(reference: str, full: str | None) -> None:
    assert full_reference(reference) == full


def test_patterns_match_the_full_reference_only() -> None:
    policy = Policy(item_images=("registry.example.com/acme/*", "docker.io/library/python:*"))
    assert policy.image_refusal("registry.example.com/acme/app:1") is None
    assert policy.image_refusal("python:3.12") is None
    # Another org's image, a look-alike registry and a bare name of Docker Hub are refused.
    for other in ("registry.example.com/other/app:1", "registry.example.com.evil/acme/a", "app"):
        assert policy.image_refusal(other) == "not among the images this org's items may name"
    assert "reference" in (policy.image_refusal("NOT/valid") or "")


def test_the_deployment_default_holds_for_what_the_org_has_not_set() -> None:
    assert effective(None, "").image_refusal("ubuntu") == (
        "this org's items may not name an image of their own"
    )
    assert effective(None, "docker.io/library/*").image_refusal("ubuntu") is None
    own = effective((["ghcr.io/acme/*"], None), "docker.io/library/*")
    assert own.image_refusal("ubuntu") is not None  # its own list replaces the default
    assert own.region_allowed("anywhere")
    regions = effective((None, ["eu-*"]), "")
    assert regions.region_allowed("eu-west-1") and not regions.region_allowed("us-east-1")


def test_pattern_lists_are_bounded() -> None:
    assert check_patterns("regions", [" eu-* "]) == ["eu-*"]
    with pytest.raises(ValueError, match="item_images: at most 100"):
        check_patterns("item_images", ["a"] * 101)
    with pytest.raises(ValueError, match="printable"):
        check_patterns("regions", ["eu\x1b[0m"])
