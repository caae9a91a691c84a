"""The rule every environment map a client sends is held to.

A dispatch's ``env`` and ``toolchain.env``, an interactive session's ``env``, an exec's
``env`` and the names of ``egress.secret_bindings`` all reach a process's environment. A name
must be a POSIX environment name (``[A-Za-z_][A-Za-z0-9_]*``, at most 255 characters); names
the dynamic loader or glibc act on are refused, wherever the variable would end up. Values
hold no NUL and are bounded: each ``NAME=value`` within what ``execve`` takes for one
variable, and a whole map within a share of what it takes for all of them.

A refusal names the rule, and a refused name only when it is one of this module's own list:
never a name or value the client chose.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated

from pydantic import AfterValidator

from corral.shared.errors import CorralError
from corral.shared.keyring import is_sealed
from corral.shared.text import NulFree

MAX_NAME = 255
# Linux's MAX_ARG_STRLEN: execve refuses a longer "NAME=value" string (E2BIG).
MAX_ENTRY_BYTES = 131_072
# One map's "NAME=value" strings together. Three maps meet in one environment (a
# toolchain's, a dispatch's or session's, an exec's): together well under the 2 MiB execve
# takes for argv and environment with the usual 8 MiB stack, leaving corral's own variables
# (a CA bundle may be 64 KiB) room.
MAX_ENV_BYTES = 262_144
_POSIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# glibc's secure-mode list, sysdeps/generic/unsecvars.h (UNSECURE_ENVVARS: what ld.so strips
# from a set-user-ID program's environment), with what acts on each name; a few names of
# older releases' lists (LD_BIND_NOW...) too. Beyond the list, every LD_* name is the
# dynamic loader's (it may learn new ones) and every MALLOC_* name glibc's malloc's (its
# tunables' aliases: MALLOC_CHECK_, MALLOC_ARENA_MAX...). TMPDIR, on the list, is kept:
# work uses it as every program does (a build's or pip's scratch space), it makes no process
# load anything, and glibc lists it only so that a privileged program never writes where its
# caller says; a tenant's env is handed to the work alone, which has no more privilege than
# the tenant.
_LOADER = "the dynamic loader"
_RESOLVER = "glibc's resolver"
REFUSED_NAMES = {
    **dict.fromkeys(
        (
            "LD_AUDIT",
            "LD_BIND_NOT",
            "LD_BIND_NOW",
            "LD_DEBUG",
            "LD_DEBUG_OUTPUT",
            "LD_DYNAMIC_WEAK",
            "LD_HWCAP_MASK",
            "LD_LIBRARY_PATH",
            "LD_ORIGIN_PATH",
            "LD_PRELOAD",
            "LD_PROFILE",
            "LD_SHOW_AUXV",
            "LD_USE_LOAD_BIAS",
            "GLIBC_TUNABLES",
        ),
        _LOADER,
    ),
    **dict.fromkeys(("HOSTALIASES", "LOCALDOMAIN", "RESOLV_HOST_CONF", "RES_OPTIONS"), _RESOLVER),
    "GCONV_PATH": "glibc's iconv (it loads modules from there)",
    "GETCONF_DIR": "glibc's getconf (it runs programs from there)",
    "LOCPATH": "glibc (it loads locales from there)",
    "MALLOC_TRACE": "glibc's malloc",
    "NIS_PATH": "glibc's NIS+ lookups",
    "NLSPATH": "glibc (it loads message catalogues from there)",
    "TZDIR": "glibc (it loads time zone files from there)",
}
REFUSED_PREFIXES = {"LD_": _LOADER, "MALLOC_": "glibc's malloc"}
NOT_A_NAME = (
    "a name is not an environment variable name: letters, digits and _, not starting with "
    f"a digit, at most {MAX_NAME} characters"
)


class EnvRefusedError(CorralError, ValueError):
    """an environment variable's name or value is refused"""

    code = "invalid_message"


def check_env_name(name: str) -> str:
    """``name`` unchanged, when a client may set it.

    Raises:
        EnvRefusedError: not a POSIX name, too long, or one the loader or libc act on.
    """
    if len(name) > MAX_NAME or not _POSIX_NAME.fullmatch(name):
        raise EnvRefusedError(NOT_A_NAME)
    if name in REFUSED_NAMES:
        raise EnvRefusedError(f"{name} is refused: {REFUSED_NAMES[name]} acts on it")
    for prefix, actor in REFUSED_PREFIXES.items():
        if name.startswith(prefix):
            # Named by its prefix alone: the rest of the name is the client's.
            raise EnvRefusedError(f"a name starting with {prefix} is refused: {actor} acts on it")
    return name


def check_env_names(names: Iterable[str]) -> None:
    """Check every name of ``names`` (:func:`check_env_name`).

    Raises:
        EnvRefusedError: the first name refused.
    """
    for name in names:
        check_env_name(name)


def check_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` unchanged, when its names may be set and its values are within the bounds.

    The stored message holds each value sealed (:mod:`corral.shared.store.sealing`) and is
    validated again when it is routed: a sealed value was measured before it was sealed,
    and is not measured again (its token is a third larger than the value). So a client's
    value that merely starts as a sealed one does is bounded by the message's size limit
    alone; measuring it would refuse its stored form at routing, not at intake.

    Raises:
        EnvRefusedError: a name refused, a ``NAME=value`` over :data:`MAX_ENTRY_BYTES` or
            all of them over :data:`MAX_ENV_BYTES`.
    """
    total = 0
    for name, value in env.items():
        check_env_name(name)
        if is_sealed(value):
            continue
        entry = len(name) + 1 + len(value.encode()) + 1  # NAME=value and its NUL
        if entry > MAX_ENTRY_BYTES:
            raise EnvRefusedError(
                f"a value is too long: NAME=value is at most {MAX_ENTRY_BYTES} bytes "
                "(what execve takes for one variable)"
            )
        total += entry
    if total > MAX_ENV_BYTES:
        raise EnvRefusedError(
            f"the variables are too large together: at most {MAX_ENV_BYTES} bytes of NAME=value"
        )
    return env


# An environment map from a client: every name and value under the rule above.
EnvMap = Annotated[dict[str, NulFree], AfterValidator(check_env)]
