"""Result bundles over HTTP: the runner's upload, the admin's download and review.

``PUT /v1/runner/bundle`` streams the body to a temporary file (never into memory; the body
limit middleware stops it at ``CORRAL_BUNDLE_MAX_BYTES`` plus the archive's overhead), then
checks and keeps it (:mod:`corral.shared.store.bundle_records`). ``GET /v1/work-items/{id}/bundle``
streams it back with its SHA-256; ``POST .../bundle/accept`` and ``.../reject`` decide its
review, naming that SHA-256 (``{"sha256": "..."}``): a decision is about the bundle the
reviewer downloaded, never one that replaced it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from functools import partial
from typing import Any, BinaryIO

from fastapi import HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from corral.scheduler.admin.responses import BundleReviewed, BundleStored
from corral.scheduler.api.bodies import BODY
from corral.scheduler.api.http_errors import (
    Conflict,
    ErrorAnswer,
    InvalidRequest,
    ServiceUnavailable,
    problem,
)
from corral.shared.errors import ConfigurationError
from corral.shared.runtime import Runtime
from corral.shared.store.bundle_records import (
    SHA256_PATTERN,
    BundleChangedError,
    BundleStateError,
    Upload,
    open_bundle,
    review_bundle,
    save_bundle,
)
from corral.shared.store.bundle_store import BundleStore, BundleStoreError, make_bundle_store
from corral.shared.store.bundles import BundleInvalidError, BundleTooLargeError
from corral.shared.store.models import BundleReview

ACTOR = "api"
_CHUNK = 1024 * 1024
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
    }
}
DOWNLOAD_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the bundle archive (a gzipped tar)",
        "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
    }
}
REVIEW_ANSWERS: dict[int | str, dict[str, Any]] = {
    409: {
        "model": ErrorAnswer,
        "description": "bundle_changed: the bundle is not the one the sha256 names (download "
        "it again); item_running: the item has not ended; bundle_conflict: the bundle is not "
        "held for review, or was decided the other way.",
    }
}


class BundleDecision(BaseModel):
    """A review decision's body: the bundle decided on, by its SHA-256."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(
        pattern=SHA256_PATTERN,
        description="the SHA-256 of the bundle reviewed, as its download's "
        "X-Corral-Bundle-Sha256 header gave it",
    )


def bundle_store(rt: Runtime) -> BundleStore:
    """The process's bundle store (``CORRAL_BUNDLE_STORE``), made on first use.

    Raises:
        ServiceUnavailable: the store is misconfigured (``corral api`` checks it at start).
    """
    try:
        return rt.part("bundle_store", lambda built: make_bundle_store(built.settings))
    except ConfigurationError as exc:
        raise ServiceUnavailable("bundle_store_unconfigured", exc.message) from exc


async def receive_upload(rt: Runtime, work_item_id: str, sandbox_id: str, request: Request) -> Any:
    """Spool the body, then check and keep it as ``work_item_id``'s bundle (sent from
    ``sandbox_id``, its current attempt's); the answer."""
    upload = await _spool(request)
    try:
        review = await run_in_threadpool(
            partial(save_bundle, actor="runner", sandbox_id=sandbox_id),
            rt.db,
            bundle_store(rt),
            rt.settings,
            work_item_id,
            upload,
        )
    except BundleTooLargeError as exc:
        return problem(413, exc.code, BODY, exc.message, limit_bytes=rt.settings.bundle_max_bytes)
    except BundleInvalidError as exc:
        raise InvalidRequest(BODY, exc.message, error=exc.code) from exc
    except BundleStateError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="work item not found") from exc
    except BundleStoreError as exc:
        raise ServiceUnavailable(exc.code, exc.message) from exc
    finally:
        os.unlink(upload.path)
    return BundleStored(review=review)


async def _spool(request: Request) -> Upload:
    """The body in a temporary file, with its size and SHA-256."""
    digest, size = hashlib.sha256(), 0
    handle, path = tempfile.mkstemp(prefix="corral-bundle-upload-")
    try:
        with os.fdopen(handle, "wb") as spool:
            async for chunk in request.stream():
                digest.update(chunk)
                size += len(chunk)
                spool.write(chunk)
    except BaseException:
        os.unlink(path)
        raise
    return Upload(path=path, size=size, sha256=digest.hexdigest())


def get_bundle(rt: Runtime, item_id: str) -> Response:
    """The item's bundle archive, streamed; its review in ``X-Corral-Bundle-Review``
    (the caller checked that it may see the item)."""
    try:
        view, stream = open_bundle(rt.db, bundle_store(rt), item_id)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="no result bundle") from exc
    except BundleStoreError as exc:
        raise ServiceUnavailable(exc.code, exc.message) from exc
    headers = {
        "Content-Length": str(view["size_bytes"]),
        "X-Corral-Bundle-Review": view["review"],
        "X-Corral-Bundle-Sha256": view["sha256"],
        "Content-Disposition": f'attachment; filename="{item_id}.tar.gz"',
    }
    return StreamingResponse(_chunks(stream), media_type="application/gzip", headers=headers)


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    with stream:
        while chunk := stream.read(_CHUNK):
            yield chunk


def decide(
    rt: Runtime, item_id: str, decision: BundleReview, body: BundleDecision
) -> BundleReviewed:
    """Accept or reject the item's bundle, if it is still the one ``body`` names (the caller
    checked that it may review the item); 409 with a code otherwise."""
    try:
        review = review_bundle(rt.db, item_id, decision, sha256=body.sha256, actor=ACTOR)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="no result bundle") from exc
    except BundleChangedError as exc:
        raise Conflict(exc.code, "sha256", exc.message) from exc
    except BundleStateError as exc:
        raise Conflict(exc.code, "(request)", exc.message) from exc
    return BundleReviewed(id=item_id, review=BundleReview(review))
