"""Strings and numbers a client may send, refused at the boundary when they cannot be stored
or run: PostgreSQL text holds no NUL, a process's argv and environment hold no NUL, and an
integer column holds 32 or 64 bits. Each refusal names the rule, never the value.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

# Ids and names: letters, digits, '.', '_', '-', up to 63, starting with a letter or digit.
IDENTIFIER = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MAX = 2**63 - 1


def refuse_nul(value: str) -> str:
    """``value`` unchanged.

    Raises:
        ValueError: it holds a NUL character.
    """
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def refuse_control(value: str) -> str:
    """``value`` unchanged.

    Raises:
        ValueError: it holds a control character (C0, DEL or C1), NUL included.
    """
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value):
        raise ValueError("must not contain control characters")
    return value


# Commands, env values, code: anything but NUL.
NulFree = Annotated[str, AfterValidator(refuse_nul)]
# Names and one-line values (a model name, an idempotency key): printable characters only.
Printable = Annotated[str, AfterValidator(refuse_control)]
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]


def storable_line(value: object, max_length: int = 255) -> str | None:
    """``value`` if it is one line of printable text of at most ``max_length`` characters
    that every database and broker key holds (no control character, NUL included, and no
    lone surrogate), else None."""
    if not isinstance(value, str) or not 0 < len(value) <= max_length:
        return None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF for c in value):
        return None
    return value
