"""Result bundles as the control plane reads them: every member checked, whoever made it.

A bundle is a gzipped tar (docs/runner-protocol.md#result-bundles): ``manifest.json`` first,
then ``patches/NNNN.diff`` and ``files/<path>`` members the manifest names. :func:`read_bundle`
reads one as a stream, once, and refuses it (:class:`BundleInvalidError`, or
:class:`BundleTooLargeError` past a limit) as soon as a member is not what the format allows:
a header that is not a plain ustar regular file's (a pax or GNU extended header, a link, a
device; :mod:`corral.shared.store.bundle_tar` checks each before anything reads what it declares),
an absolute path, a ``..`` or ``.git`` component, a file whose size or SHA-256 is not the
manifest's, a member the manifest does not name, more than the limits. Its sizes are counted
uncompressed, from each header before its payload is read, and nothing else is inflated but
headers, padding and a few kB of end padding, so a small archive that would inflate to
gigabytes is refused once it passes the limit. Messages never quote a path from the bundle.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from corral.shared.errors import CorralError
from corral.shared.store.bundle_tar import TarFormatError, TarMember, TarReader

MANIFEST = "manifest.json"
BUNDLE_TOO_LARGE = "bundle_too_large"
BUNDLE_INVALID = "bundle_invalid"
MAX_MEMBERS = 200_000
_CHUNK = 1024 * 1024


class BundleError(CorralError):
    """The result bundle was refused."""


class BundleTooLargeError(BundleError):
    """The result bundle is over a limit."""

    code = BUNDLE_TOO_LARGE


class BundleInvalidError(BundleError, ValueError):
    """The result bundle is not in the bundle format."""

    code = BUNDLE_INVALID


@dataclass(frozen=True)
class BundleLimits:
    """What one bundle may hold; its size counts its members' bytes, uncompressed."""

    max_bytes: int
    max_manifest_bytes: int
    max_patches: int


def check_path(path: str) -> str:
    """``path`` unchanged when it is a relative path that stays where it is put.

    Raises:
        ValueError: empty, absolute, with an empty, ``.``, ``..`` or ``.git`` component, a
            NUL, or longer than 4096 characters.
    """
    parts = path.split("/")
    if not path or len(path) > 4096 or "\x00" in path or path.startswith("/"):
        raise ValueError("a path must be relative, non-empty and without NUL")
    if any(part in ("", ".", "..") or part.lower() == ".git" for part in parts):
        raise ValueError("a path must not have empty, '.', '..' or '.git' components")
    return path


class ManifestEntry(BaseModel):
    """One changed path."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    operation: Literal["add", "modify", "delete"]
    type: Literal["file", "symlink"] | None
    size: int | None = Field(ge=0)
    sha256: str | None = Field(pattern=r"^[0-9a-f]{64}$")
    mode: int | None = Field(ge=0, le=0o777)
    target: str | None
    patch: str | None = Field(pattern=r"^patches/[0-9]{4,6}\.diff$")
    file: str | None

    _path = field_validator("path")(check_path)

    def check(self) -> None:
        """Raises ValueError when the entry's fields do not fit its operation and type."""
        if self.operation == "delete":
            if self.type is not None or self.file is not None:
                raise ValueError("a deleted entry has no type and no file")
            return
        if self.type == "file" and (self.file != f"files/{self.path}" or self.size is None):
            raise ValueError("a file entry names its file member files/<path> and its size")
        if self.type == "symlink":
            if self.file is not None or not self.target or self.target.startswith("/"):
                raise ValueError("a symlink entry has a relative target and no file member")
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(self.path), self.target))
            if resolved == ".." or resolved.startswith("../"):
                raise ValueError("a symlink entry points outside the workspace")
        if self.sha256 is None:
            raise ValueError("an added or modified entry has its sha256")


class Refused(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(max_length=8192)
    reason: str = Field(max_length=1000)


class Manifest(BaseModel):
    """``manifest.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1]
    base: dict[str, str | None]
    entries: tuple[ManifestEntry, ...]
    refused: tuple[Refused, ...] = ()


# Called for each patch and file member once checked: the entry it belongs to, its member
# name, and where to copy its bytes (None: nowhere); read_bundle closes that stream.
MemberSink = Callable[[ManifestEntry, str], IO[bytes] | None]


@dataclass
class _Reading:
    limits: BundleLimits
    manifest: Manifest | None = None
    expected: dict[str, ManifestEntry] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    content_bytes: int = 0
    patches: int = 0

    def count(self, size: int) -> None:
        self.content_bytes += size
        if self.content_bytes > self.limits.max_bytes:
            raise BundleTooLargeError(
                f"the bundle holds more than the limit of {self.limits.max_bytes} bytes "
                "(uncompressed)"
            )


@dataclass(frozen=True)
class BundleContents:
    """A checked bundle: its manifest and how many bytes its members hold."""

    manifest: Manifest
    content_bytes: int

    _OPERATIONS: ClassVar[tuple[str, ...]] = ("add", "modify", "delete")

    def counts(self) -> dict[str, int]:
        found = {operation: 0 for operation in self._OPERATIONS}
        for entry in self.manifest.entries:
            found[entry.operation] += 1
        return found


def read_bundle(
    source: BinaryIO, limits: BundleLimits, sink: MemberSink | None = None
) -> BundleContents:
    """Check the bundle ``source`` streams (a gzipped tar), member by member.

    Raises:
        BundleTooLargeError: over ``limits``.
        BundleInvalidError: not in the bundle format.
    """
    reading = _Reading(limits)
    try:
        with gzip.GzipFile(fileobj=source, mode="rb") as inflated:
            archive = TarReader(inflated)
            for member in archive:
                if member.number > MAX_MEMBERS:
                    raise BundleInvalidError(f"the bundle has more than {MAX_MEMBERS} members")
                _member(archive, member, reading, sink)
    except TarFormatError as exc:
        raise BundleInvalidError(exc.message) from exc
    if reading.manifest is None:
        raise BundleInvalidError("the bundle has no manifest.json")
    missing = set(reading.expected) - reading.seen
    if missing:
        raise BundleInvalidError(f"{len(missing)} members the manifest names are missing")
    return BundleContents(reading.manifest, reading.content_bytes)


def _member(
    archive: TarReader, member: TarMember, reading: _Reading, sink: MemberSink | None
) -> None:
    """Check ``member`` (its header read, a plain file's) and read its payload."""
    where = f"member {member.number}"
    try:
        check_path(member.name)
    except ValueError as exc:
        raise BundleInvalidError(f"{where}'s path leaves the bundle: {exc}") from exc
    reading.count(member.size)  # before a byte of its payload is read
    if reading.manifest is None:
        if member.name != MANIFEST:
            raise BundleInvalidError("the bundle's first member must be manifest.json")
        reading.manifest = _manifest(archive, member.size, reading)
        return
    entry = reading.expected.get(member.name)
    if entry is None or member.name in reading.seen:
        raise BundleInvalidError(f"{where} is not named by the manifest, or comes twice")
    reading.seen.add(member.name)
    is_file = member.name == entry.file
    if is_file and member.size != entry.size:
        raise BundleInvalidError(f"{where}'s size or sha256 is not the manifest's")
    target = sink(entry, member.name) if sink is not None else None
    try:
        digest = _copy(archive, target)
    finally:
        if target is not None:
            target.close()
    if is_file and digest != entry.sha256:
        raise BundleInvalidError(f"{where}'s size or sha256 is not the manifest's")


def _manifest(archive: TarReader, size: int, reading: _Reading) -> Manifest:
    limits = reading.limits
    if size > limits.max_manifest_bytes:
        raise BundleTooLargeError(
            f"the bundle's manifest is over the limit of {limits.max_manifest_bytes} bytes"
        )
    try:
        manifest = Manifest.model_validate(json.loads(archive.read(size)))
        for entry in manifest.entries:
            entry.check()
    except (ValueError, ValidationError) as exc:
        raise BundleInvalidError(f"the manifest is invalid: {_reason(exc)}") from exc
    paths = [entry.path for entry in manifest.entries]
    if len(set(paths)) != len(paths):
        raise BundleInvalidError("the manifest names a path twice")
    for entry in manifest.entries:
        for name in (entry.patch, entry.file):
            if name is not None:
                if name in reading.expected:
                    raise BundleInvalidError("the manifest names a member twice")
                reading.expected[name] = entry
    reading.patches = sum(1 for entry in manifest.entries if entry.patch)
    if reading.patches > limits.max_patches:
        raise BundleTooLargeError(
            f"the bundle has {reading.patches} patches, more than the limit of {limits.max_patches}"
        )
    return manifest


def _reason(exc: Exception) -> str:
    """Why, naming fields by their place and the rule, never by their values."""
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        if first["type"] == "value_error":  # our own validators' words
            return f"{where}: {str(first['msg']).removeprefix('Value error, ')}"
        return f"{where}: {first['type']}"
    return str(exc)  # JSON's and check()'s messages quote nothing of the bundle


def _copy(archive: TarReader, target: IO[bytes] | None) -> str:
    digest = hashlib.sha256()
    while chunk := archive.read(_CHUNK):
        digest.update(chunk)
        if target is not None:
            target.write(chunk)
    return digest.hexdigest()


def manifest_json(contents: BundleContents) -> Any:
    """The manifest as JSON values."""
    return contents.manifest.model_dump(mode="json")
