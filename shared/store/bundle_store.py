"""Where result bundles are kept: one small interface, three places.

Bundles up to ``CORRAL_BUNDLE_INLINE_MAX_BYTES`` live in their ``work_item_bundles`` row
(PostgreSQL or SQLite); larger ones in the configured store, a directory
(:class:`FilesystemBundleStore`) or an S3-compatible bucket (:class:`S3BundleStore`, through
boto3, the ``s3`` extra). :class:`InMemoryBundleStore` is the fake for tests.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, BinaryIO

from corral.shared.errors import ConfigurationError, CorralError
from corral.shared.settings import BundleSettings

DATABASE = "database"


class BundleStoreError(CorralError):
    """The bundle store failed."""

    code = "bundle_store_error"


class BundleStore(ABC):
    """Keeps bundle archives by key."""

    name: str

    @abstractmethod
    def put(self, key: str, source: BinaryIO) -> None:
        """Store ``source``'s bytes (read from where it is to its end) under ``key``.

        Raises:
            BundleStoreError: the store could not keep it.
        """

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A readable stream of the bundle under ``key``; the caller closes it.

        Raises:
            BundleStoreError: not there, or the store cannot be read.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key``; a missing one is not an error.

        Raises:
            BundleStoreError: the store could not delete it.
        """


class FilesystemBundleStore(BundleStore):
    """One file per bundle in ``directory`` (shared by every api replica that serves it)."""

    name = "filesystem"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise BundleStoreError("a bundle key is one plain file name")
        return self.directory / key

    def put(self, key: str, source: BinaryIO) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self._path(key)
        # Written beside, then renamed: a reader never sees half a bundle.
        handle, partial = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
        try:
            with os.fdopen(handle, "wb") as out:
                shutil.copyfileobj(source, out)
            os.replace(partial, target)
        except OSError as exc:
            Path(partial).unlink(missing_ok=True)
            raise BundleStoreError(f"could not write the bundle: {exc.strerror}") from exc

    def open(self, key: str) -> BinaryIO:
        try:
            return self._path(key).open("rb")
        except OSError as exc:
            raise BundleStoreError(f"could not read the bundle: {exc.strerror}") from exc

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class InMemoryBundleStore(BundleStore):
    """The fake: bundles in a dict, and every call recorded."""

    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []

    def put(self, key: str, source: BinaryIO) -> None:
        self.calls.append(("put", key))
        self.objects[key] = source.read()

    def open(self, key: str) -> BinaryIO:
        self.calls.append(("open", key))
        if key not in self.objects:
            raise BundleStoreError("no such bundle")
        return io.BytesIO(self.objects[key])

    def delete(self, key: str) -> None:
        self.calls.append(("delete", key))
        self.objects.pop(key, None)


class S3BundleStore(BundleStore):
    """Objects ``<prefix><key>`` in an S3-compatible bucket, through boto3."""

    name = "s3"

    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def put(self, key: str, source: BinaryIO) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            self.client.upload_fileobj(source, self.bucket, self.prefix + key)
        except (BotoCoreError, ClientError) as exc:
            raise BundleStoreError(f"could not store the bundle in S3: {exc}") from exc

    def open(self, key: str) -> BinaryIO:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except (BotoCoreError, ClientError) as exc:
            raise BundleStoreError(f"could not read the bundle from S3: {exc}") from exc
        body: BinaryIO = answer["Body"]
        return body

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except (BotoCoreError, ClientError) as exc:
            raise BundleStoreError(f"could not delete the bundle from S3: {exc}") from exc

    def close(self) -> None:
        """Close the client's pooled connections (a store made for a while, e.g. in tests)."""
        self.client.close()


def make_bundle_store(settings: BundleSettings) -> BundleStore:
    """The store ``settings`` choose (``CORRAL_BUNDLE_STORE``).

    Raises:
        ConfigurationError: s3 without a bucket, or without boto3 installed.
    """
    if settings.bundle_store == "filesystem":
        return FilesystemBundleStore(settings.resolved_bundle_dir())
    if not settings.bundle_s3_bucket:
        raise ConfigurationError(
            "CORRAL_BUNDLE_STORE=s3 needs CORRAL_BUNDLE_S3_BUCKET (and, for a store other "
            "than AWS, CORRAL_BUNDLE_S3_ENDPOINT_URL)"
        )
    try:
        import boto3  # noqa: PLC0415 - only when the s3 store is chosen
    except ImportError as exc:
        raise ConfigurationError(
            "CORRAL_BUNDLE_STORE=s3 needs boto3: pip install 'corral[s3]'"
        ) from exc
    # A session of its own: boto3's default one is shared, not thread-safe, and keeps the
    # credentials it first found.
    client = boto3.session.Session().client(
        "s3", endpoint_url=settings.bundle_s3_endpoint_url, region_name=settings.bundle_s3_region
    )
    return S3BundleStore(client, settings.bundle_s3_bucket, settings.bundle_s3_prefix)
