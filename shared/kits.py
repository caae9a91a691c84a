"""The kit catalogue: what a dispatch's ``toolchain.kits`` entries (``kitId@version``) mean.

The catalogue ships with corral (``kits.json`` beside this module: node, python, go) and a
deployment extends or overrides it with a file of its own (``CORRAL_KIT_CATALOGUE``, JSON,
the same shape), merged over the built-in one version by version. Each version says:

- ``check``: a shell command that succeeds when the sandbox has the tool at that version
  (on its ``PATH``, which the kit's tool-cache directory is put in front of);
- ``tool_cache``: the tool's ``bin`` directory under the deployment's tool cache (the
  directory a provider's ``tool_cache_dir`` mounts read-only into the sandbox, named by
  ``CORRAL_TOOL_CACHE``): that is how a kit is satisfied offline;
- ``install`` (optional): commands run when ``check`` fails, e.g. a download from a mirror
  the deployment names (a URL template is the deployment's own shell text);
- ``env`` (optional): variables for the later steps and the work.

A work item's kits resolve, in the order given and without repeats, into one install step
per kit, placed before its own ``toolchain.install_commands``: run ``install`` if ``check``
fails, then ``check`` again, which fails the item ``install_failed`` with a message naming
the kit and where it was looked for. An unknown kit or version is refused when the message
is validated (``invalid_message``, listing the known ones).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corral.shared.errors import ConfigurationError

BUILTIN = Path(__file__).with_name("kits.json")
CATALOGUE_ENV = "CORRAL_KIT_CATALOGUE"
TOOL_CACHE_ENV = "CORRAL_TOOL_CACHE"


class KitVersion(BaseModel):
    """One version of a kit in the catalogue."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    check: str = Field(min_length=1)
    tool_cache: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._/-]+$")
    install: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedKits:
    """What a work item's kits add to its toolchain."""

    install_commands: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    path: tuple[str, ...] = ()  # put in front of PATH, "$VAR" expanded in the sandbox


class KitError(ValueError):
    """A kit reference the catalogue cannot resolve (the message names it)."""


@dataclass(frozen=True)
class Catalogue:
    kits: Mapping[str, Mapping[str, KitVersion]]

    def known(self) -> str:
        return ", ".join(
            f"{kit}@{version}"
            for kit, versions in sorted(self.kits.items())
            for version in versions
        )

    def lookup(self, reference: str) -> tuple[str, str, KitVersion]:
        """``(kit, version, entry)`` of ``kit@version``.

        Raises:
            KitError: malformed, or no such kit or version; the message lists the known ones.
        """
        kit, at, version = reference.partition("@")
        if not at or not kit or not version:
            raise KitError(f"a kit is named kit@version, e.g. node@20; known: {self.known()}")
        versions = self.kits.get(kit)
        if versions is None:
            raise KitError(f"unknown kit {kit}; known: {self.known()}")
        entry = versions.get(version)
        if entry is None:
            raise KitError(
                f"unknown version {version} of kit {kit}; known: {', '.join(sorted(versions))}"
            )
        return kit, version, entry

    def resolve(self, references: Sequence[str]) -> ResolvedKits:
        """The kits' steps, env and path, in order and without repeats.

        Raises:
            KitError: an unknown kit or version, or two versions of one kit.
        """
        if not references:
            return ResolvedKits()
        chosen: dict[str, str] = {}
        steps: list[str] = []
        env: dict[str, str] = {}
        path: list[str] = []
        for reference in references:
            kit, version, entry = self.lookup(reference)
            if chosen.setdefault(kit, version) != version:
                raise KitError(f"kit {kit} is asked for twice: {kit}@{chosen[kit]} and {reference}")
            step = _step(reference, entry)
            if step not in steps:
                steps.append(step)
            env.update(entry.env)
            if entry.tool_cache:
                directory = f"${{{TOOL_CACHE_ENV}}}/{entry.tool_cache}"
                if directory not in path:
                    path.append(directory)
        return ResolvedKits(tuple(steps), env, tuple(path))


def _step(reference: str, entry: KitVersion) -> str:
    where = "its check"
    if entry.tool_cache:
        where = f"not on PATH, nor in the tool cache (${TOOL_CACHE_ENV}/{entry.tool_cache})"
    refusal = (
        f"kit {reference} is not satisfied in this sandbox ({where}): use an image that has "
        f"it, give the provider a tool_cache_dir holding {entry.tool_cache or 'it'}, or add an "
        "install to the kit's catalogue entry"
    )
    check = f"{{ {entry.check}; }}"
    install = " && ".join(f"{{ {command}; }}" for command in entry.install)
    first = f"{check} || {{ {install}; }}; " if install else ""
    return f"{first}{check} || {{ echo {shlex.quote(refusal)} >&2; exit 1; }}"


def _versions(raw: Any, source: str) -> dict[str, dict[str, KitVersion]]:
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigurationError(f"kit catalogue {source}: expected {{kit: {{version: entry}}}}")
    try:
        return {
            str(kit): {str(v): KitVersion.model_validate(e) for v, e in versions.items()}
            for kit, versions in raw.items()
        }
    except ValidationError as exc:
        raise ConfigurationError(f"kit catalogue {source}: {exc}") from exc


@functools.cache
def load(extra: str | None = None) -> Catalogue:
    """The built-in catalogue, with ``extra``'s kits and versions merged over it.

    Raises:
        ConfigurationError: ``extra`` cannot be read or is not a catalogue.
    """
    kits = _versions(json.loads(BUILTIN.read_text(encoding="utf-8")), "built-in")
    if extra:
        try:
            raw = json.loads(Path(extra).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"{CATALOGUE_ENV}={extra}: {exc}") from exc
        for kit, versions in _versions(raw, extra).items():
            kits[kit] = {**kits.get(kit, {}), **versions}
    return Catalogue(kits)


def current() -> Catalogue:
    """The catalogue of this process's deployment (``CORRAL_KIT_CATALOGUE``).

    Raises:
        ConfigurationError: that file cannot be read or is not a catalogue.
    """
    return load(os.environ.get(CATALOGUE_ENV) or None)


def resolve(references: Sequence[str]) -> ResolvedKits:
    """``references`` resolved with the deployment's catalogue (not read when empty).

    Raises:
        KitError: an unknown kit or version, or two versions of one kit.
        ConfigurationError: the deployment's catalogue is broken.
    """
    return current().resolve(references) if references else ResolvedKits()
