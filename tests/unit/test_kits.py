"""The kit catalogue: references resolve into install steps, env and path, in order and
without repeats; unknown ones are invalid messages; a deployment's file extends it; and the
steps really check, and refuse with a message naming the kit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from corral.runner.phases import with_path
from corral.shared import kits
from corral.shared.messages import DispatchRequest, field_errors


@pytest.fixture(autouse=True)
def fresh_catalogue(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(kits.CATALOGUE_ENV, raising=False)
    kits.load.cache_clear()
    yield
    kits.load.cache_clear()


def message(*kit_refs: str) -> dict[str, object]:
    return {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        "toolchain": {"kits": list(kit_refs), "install_commands": ["make deps"]},
    }


def test_kits_resolve_in_order_without_repeats() -> None:
    resolved = kits.current().resolve(["node@20", "go@1.22", "node@20"])
    assert len(resolved.install_commands) == 2
    assert "node --version" in resolved.install_commands[0]
    assert "go version" in resolved.install_commands[1]
    assert resolved.path == ("${CORRAL_TOOL_CACHE}/node/20/bin", "${CORRAL_TOOL_CACHE}/go/1.22/bin")
    assert resolved.env == {"GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    assert kits.current().resolve([]) == kits.ResolvedKits()


@pytest.mark.parametrize(
    ("reference", "words"),
    [
        ("ruby@3", "unknown kit ruby; known: go@1.22, go@1.23, node@20, node@22, python@3.11"),
        ("node@19", "unknown version 19 of kit node; known: 20, 22"),
        ("node", "a kit is named kit@version, e.g. node@20; known: go@1.22"),
    ],
)
def test_an_unknown_kit_is_an_invalid_message_listing_the_known_ones(
    reference: str, words: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        DispatchRequest.model_validate(message(reference))
    [error] = field_errors(refused.value)
    assert error["field"] == "toolchain"
    assert words in error["message"], error


def test_two_versions_of_one_kit_are_refused() -> None:
    with pytest.raises(ValidationError, match="kit node is asked for twice: node@20 and node@22"):
        DispatchRequest.model_validate(message("node@20", "node@22"))


def test_a_deployment_catalogue_extends_and_overrides_the_built_in_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = tmp_path / "kits.json"
    extra.write_text(
        json.dumps(
            {
                "node": {"20": {"check": "node-20-is-here", "env": {"NODE_ENV": "ci"}}},
                "deno": {"2": {"check": "deno --version", "install": ["fetch-deno 2"]}},
            }
        )
    )
    monkeypatch.setenv(kits.CATALOGUE_ENV, str(extra))
    catalogue = kits.current()
    assert "deno@2" in catalogue.known() and "node@22" in catalogue.known()
    node = catalogue.resolve(["node@20"])
    assert "node-20-is-here" in node.install_commands[0]
    assert (node.env, node.path) == ({"NODE_ENV": "ci"}, ())  # replaced, not merged
    DispatchRequest.model_validate(message("deno@2"))


def test_a_broken_deployment_catalogue_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = tmp_path / "kits.json"
    extra.write_text(json.dumps({"node": {"20": {"chek": "typo"}}}))
    monkeypatch.setenv(kits.CATALOGUE_ENV, str(extra))
    with pytest.raises(kits.ConfigurationError, match="kit catalogue"):
        kits.current()
    # Items without kits never read it.
    assert DispatchRequest.model_validate(message()).toolchain.kits == ()
    with pytest.raises(ValidationError, match="kit catalogue"):
        DispatchRequest.model_validate(message("node@20"))


def _run(step: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", "-c", step], env=env, capture_output=True, text=True, check=False
    )


def test_a_kit_step_finds_the_tool_in_the_tool_cache_and_refuses_without_it(
    tmp_path: Path,
) -> None:
    resolved = kits.current().resolve(["node@20"])
    [step] = resolved.install_commands
    tools = tmp_path / "bin"  # grep alone: this host's node must not count
    tools.mkdir()
    grep = shutil.which("grep")
    assert grep is not None
    (tools / "grep").symlink_to(grep)
    base = {"PATH": str(tools)}
    refused = _run(step, base)
    assert refused.returncode == 1
    assert refused.stderr.startswith("kit node@20 is not satisfied in this sandbox")
    assert "$CORRAL_TOOL_CACHE/node/20/bin" in refused.stderr

    cache = tmp_path / "cache"
    tool = cache / "node" / "20" / "bin"
    tool.mkdir(parents=True)
    (tool / "node").write_text("#!/bin/sh\necho v20.1.2\n")
    (tool / "node").chmod(0o755)
    env = with_path({**base, "CORRAL_TOOL_CACHE": str(cache)}, resolved.path)
    assert env["PATH"].startswith(f"{tool}:")
    assert _run(step, env).returncode == 0
    # Another major version in the cache does not pass for it.
    (tool / "node").write_text("#!/bin/sh\necho v18.0.0\n")
    assert _run(step, env).returncode == 1


def test_a_path_entry_whose_variable_is_unset_is_left_out() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/home/x"}
    assert with_path(env, ("${CORRAL_TOOL_CACHE}/node/20/bin",)) == env
    assert with_path(env, ("$HOME/bin",))["PATH"] == "/home/x/bin:/usr/bin:/bin"
    assert os.pathsep == ":"
