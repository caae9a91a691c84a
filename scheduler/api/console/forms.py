"""Forms generated from a provider's JSON schema (its configuration, or a pool's sandbox
options), and the document a submitted form makes.

A field shows the value as set (a key left out shows its default as a placeholder), and an
empty field leaves the key out, so the default applies. A secret (``writeOnly``, as
pydantic describes a ``SecretStr``) is a password field that is never filled in: empty keeps
the stored secret. Scalars are passed as typed; what the form cannot parse (a number that
is not one) is passed as text, so the provider's model refuses it naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SECRET_PLACEHOLDER = "(stored; type to replace)"  # noqa: S105 - a placeholder text


@dataclass(frozen=True)
class Field:
    name: str
    title: str
    kind: str  # text, number, integer, boolean, choice, lines, json, secret
    description: str
    value: str  # as shown; never a secret's
    placeholder: str
    choices: tuple[str, ...] = ()
    prefix: str = "f"  # the form's names are prefix.name, its ids prefix-name


def submitted(form: dict[str, str], prefix: str = "f") -> dict[str, str]:
    """The texts a form submitted for the fields of ``prefix``, by field name."""
    return {k[len(prefix) + 1 :]: v for k, v in form.items() if k.startswith(f"{prefix}.")}


def _resolved(prop: dict[str, Any]) -> dict[str, Any]:
    """The property's own schema, an ``X | None`` anyOf taken as X."""
    options = [o for o in prop.get("anyOf", []) if o.get("type") != "null"]
    return {**options[0], **prop} if len(options) == 1 else prop


def _kind(prop: dict[str, Any]) -> str:
    if prop.get("writeOnly"):
        return "secret"
    if "enum" in prop:
        return "choice"
    kind = prop.get("type")
    if kind in ("string", "number", "integer", "boolean"):
        return "text" if kind == "string" else str(kind)
    if kind == "array" and prop.get("items", {}).get("type") == "string":
        return "lines"
    return "json"


def _shown(kind: str, value: Any) -> str:
    if value is None:
        return ""
    if kind == "lines":
        return "\n".join(str(v) for v in value)
    if kind == "json":
        return json.dumps(value, indent=2)
    if kind == "boolean":
        return "true" if value else "false"
    return str(value)


def fields(schema: dict[str, Any], current: dict[str, Any], prefix: str = "f") -> list[Field]:
    """The form's fields for ``schema``'s properties, filled from ``current`` (as set);
    ``prefix`` sets a form with several generated parts apart."""
    result = []
    for name, raw in schema.get("properties", {}).items():
        prop = _resolved(raw)
        kind = _kind(prop)
        default = prop.get("default")
        if kind == "secret":
            value, placeholder = "", SECRET_PLACEHOLDER if current.get(name) else "(not set)"
        else:
            value = _shown(kind, current.get(name))
            placeholder = "" if default is None else f"default: {_shown(kind, default)}"
        result.append(
            Field(
                name=name,
                title=str(prop.get("title", name)),
                kind=kind,
                description=str(prop.get("description", "")),
                value=value,
                placeholder=placeholder.replace("\n", " "),
                choices=tuple(str(c) for c in prop.get("enum", ())),
                prefix=prefix,
            )
        )
    return result


class FormError(ValueError):
    """A field the form could not read (invalid JSON); names the field, never its value."""


def _number(kind: str, text: str) -> Any:
    """The number ``text`` is, or ``text`` itself (the model then refuses it)."""
    try:
        return int(text) if kind == "integer" else float(text)
    except ValueError:
        return text


def _parsed(field: Field, text: str) -> Any:
    if field.kind in ("integer", "number"):
        return _number(field.kind, text)
    if field.kind == "boolean":
        return {"true": True, "false": False}.get(text, text)
    if field.kind == "lines":
        return [line.strip() for line in text.splitlines() if line.strip()]
    if field.kind == "json":
        try:
            return json.loads(text)
        except ValueError:
            raise FormError(f"{field.name}: not valid JSON") from None
    return text


def document(
    schema: dict[str, Any], form: dict[str, str], stored: dict[str, Any], prefix: str = "f"
) -> dict[str, Any]:
    """The configuration a submitted form makes: each filled field, typed; a secret left
    empty keeps its ``stored`` value.

    Raises:
        FormError: a JSON field that does not parse.
    """
    config: dict[str, Any] = {}
    texts = submitted(form, prefix)
    for field in fields(schema, {}):
        text = texts.get(field.name, "").strip()
        if field.kind == "secret":
            if text:
                config[field.name] = text
            elif stored.get(field.name):
                config[field.name] = stored[field.name]
        elif text:
            config[field.name] = _parsed(field, text)
    return config
