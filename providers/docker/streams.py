"""The docker provider's two streams out of a container, each read as it comes and bounded:
an exec's output (stdout and stderr kept up to a limit, the rest read and dropped) and a
file copied out (refused by the size the engine states, and stopped one byte past the
limit whatever it stated).

docker-py's ``exec_run`` and ``get_archive`` would hold a command's whole output, or leave
the archive's response for the garbage collector to close once its reader stops early; the
engine's API client (its own request helpers) keeps both in hand here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import urllib3.exceptions

from corral.providers.errors import ProviderUnavailableError, SandboxPathError
from corral.providers.size_limits import ExecOutput, copy_at_most, reads, refuse_larger

_PATH_STAT_HEADER = "X-Docker-Container-Path-Stat"


def exec_bounded(
    api: Any,
    container_id: str,
    argv: list[str],
    *,
    environment: Mapping[str, str],
    workdir: str,
    user: str,
    max_output_bytes: int,
) -> tuple[ExecOutput, int | None]:
    """Run ``argv`` in the container; its bounded output and its exit code (None: the
    stream ended before the command did, e.g. the engine went away)."""
    created = api.exec_create(
        container_id,
        argv,
        stdout=True,
        stderr=True,
        environment=dict(environment),
        workdir=workdir,
        user=user,
    )
    output = ExecOutput(max_output_bytes)
    stream = api.exec_start(created["Id"], stream=True, demux=True)
    try:
        for stdout, stderr in stream:
            output.stdout.add(stdout or b"")
            output.stderr.add(stderr or b"")
    finally:
        # The stream's close() shuts its socket, which the response's file still holds:
        # closing the response too releases both, as docker-py's own whole-output path does.
        stream.close()
        stream._response.close()
    exit_code = api.exec_inspect(created["Id"]).get("ExitCode")
    return output, exit_code


def copy_out(
    api: Any, container_id: str, origin: str, target: Path, *, source: str, max_bytes: int
) -> None:
    """Copy the regular file ``origin`` out of the container to ``target``.

    Raises:
        docker.errors.NotFound: there is no ``origin``.
        FileTooLargeError: it is larger than ``max_bytes`` (by the engine's stat, the tar
            header, or the bytes themselves).
        SandboxPathError: it is not a regular file.
        ProviderUnavailableError: the archive broke off.
    """
    response = api._get(
        api._url("/containers/{0}/archive", container_id),
        params={"path": origin},
        stream=True,
        headers={"Accept-Encoding": "identity"},
    )
    with contextlib.closing(response):
        api._raise_for_status(response)
        refuse_larger(source, _stated_size(response.headers), max_bytes)
        try:
            with tarfile.open(fileobj=response.raw, mode="r|") as archive:
                member = archive.next()
                extracted = archive.extractfile(member) if member and member.isfile() else None
                if member is None or extracted is None:
                    raise SandboxPathError(f"{source!r} is not a regular file")
                refuse_larger(source, member.size, max_bytes)
                copy_at_most(reads(extracted.read), target, max_bytes, source)
        except (tarfile.TarError, urllib3.exceptions.HTTPError) as exc:
            raise ProviderUnavailableError(
                f"the Docker Engine's copy of {source!r} broke off: {exc}"
            ) from exc


def _stated_size(headers: Mapping[str, str]) -> int | None:
    """The size in the engine's path stat header (base64 JSON), if it is there and sound."""
    try:
        stat = json.loads(base64.b64decode(headers[_PATH_STAT_HEADER]))
        return int(stat["size"])
    except (KeyError, ValueError, TypeError):
        return None
