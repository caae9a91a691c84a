"""How the console shows a capability's value in a table cell: a check mark or a dash,
lists as words, numbers with their unit, a limit left unset as "no limit"; never JSON, nor
Python's ``True`` or ``None``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.shared.store.ledger import BillingModel, format_micros

YES, NO = "\N{CHECK MARK}", "\N{EN DASH}"
# A capability's unit, by how its name ends.
UNITS = (("_seconds", " s"), ("_s", " s"), ("_mb", " MB"), ("_vcpu", " vCPU"))


def flat(capabilities: Mapping[str, Any] | None) -> dict[str, Any]:
    """The capabilities with a nested object's fields as rows of their own
    (``substrate.runtime_kinds``), in their order."""
    rows: dict[str, Any] = {}
    for name, value in (capabilities or {}).items():
        if isinstance(value, Mapping):
            rows.update({f"{name}.{inner}": v for inner, v in value.items()})
        else:
            rows[name] = value
    return rows


def label(name: str) -> str:
    """``substrate.runtime_kinds`` → ``substrate: runtime kinds``."""
    return name.replace(".", ": ").replace("_", " ")


def cell(name: str, value: Any) -> str:
    """``value`` of the capability ``name`` as a cell shows it."""
    if isinstance(value, bool) or value is None:
        return {True: YES, False: NO, None: "no limit" if name.startswith("max_") else NO}[value]
    if isinstance(value, int | float):
        unit = next((u for end, u in UNITS if name.endswith(end)), "")
        return f"{value:,g}{unit}" if isinstance(value, float) else f"{value:,}{unit}"
    if isinstance(value, Mapping):
        return "; ".join(f"{label(k)}: {cell(k, v)}" for k, v in value.items()) or NO
    if isinstance(value, list | tuple | set | frozenset):
        words = [str(v) for v in value]
        return "any" if words == ["*"] else ", ".join(words) or "none"
    return str(value)


# What a pool's rate is per, by billing model (ledger.price prices them).
RATE_PER: dict[str, str] = {
    BillingModel.WALL_CLOCK: "a second of wall clock",
    BillingModel.FIXED: "a sandbox session",
    BillingModel.ACTIVE_CPU: "a CPU second",
}


def money(micros: int, unit: str) -> str:
    """``250000`` → ``0.250000 USD``: micro-units as a decimal of the rate cards' unit."""
    return f"{format_micros(micros)} {unit}"


def rate(billing_model: str, micros: int, unit: str) -> str:
    """A pool's rate card as a sentence: ``0.250000 USD a second of wall clock``."""
    return f"{money(micros, unit)} {RATE_PER.get(billing_model, 'a unit')}"
