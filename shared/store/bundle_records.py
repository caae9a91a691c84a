"""A work item's result bundle in the system of record: stored, read, reviewed.

:func:`save_bundle` checks an uploaded archive (:mod:`corral.shared.store.bundles`) and keeps it,
in its row when small, else in the bundle store; a refused one fails the item
(``bundle_too_large`` or ``bundle_invalid``) and nothing is kept. :func:`review_bundle`
accepts or rejects a bundle held as ``review_requested``, once its item has ended and only
if it is the bundle the reviewer names by its SHA-256: the bundle's review changes, with its
lifecycle event; the item's own state and outcome stay what the work reported.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from corral.shared.errors import CorralError
from corral.shared.messages import stored_request
from corral.shared.settings import BundleSettings
from corral.shared.store.bundle_store import DATABASE, BundleStore
from corral.shared.store.bundles import BundleError, BundleLimits, read_bundle
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import bundle_transition, transition
from corral.shared.store.models import (
    BundleReview,
    ItemState,
    LifecycleEvent,
    Sandbox,
    WorkItem,
    WorkItemBundle,
)

DECISIONS = (BundleReview.ACCEPTED, BundleReview.REJECTED)
# How a reviewer names the bundle decided on: its SHA-256, in either case.
SHA256_PATTERN = r"^[0-9a-fA-F]{64}$"

log = logging.getLogger(__name__)


class BundleStateError(CorralError):
    """The bundle cannot change this way now."""

    code = "bundle_conflict"


class ItemRunningError(BundleStateError):
    """The item has not ended: its bundle is reviewed once it has."""

    code = "item_running"


class BundleChangedError(BundleStateError):
    """The bundle changed since the one reviewed: download it again and review that."""

    code = "bundle_changed"


@dataclass(frozen=True)
class Upload:
    """An uploaded archive, spooled to a file: where, how big, its SHA-256."""

    path: str
    size: int
    sha256: str


def bundle_limits(settings: BundleSettings) -> BundleLimits:
    return BundleLimits(
        max_bytes=settings.bundle_max_bytes,
        max_manifest_bytes=settings.bundle_max_manifest_bytes,
        max_patches=settings.bundle_max_patches,
    )


def save_bundle(
    db: Database,
    store: BundleStore,
    settings: BundleSettings,
    item_id: str,
    upload: Upload,
    *,
    actor: str,
    sandbox_id: str | None = None,
) -> BundleReview:
    """Check and keep the bundle of running item ``item_id``, sent from ``sandbox_id`` (which
    must be its current attempt's); its review state.

    Raises:
        BundleError: refused (the item failed with its code, unless it had already ended).
        BundleStateError: the item is not running, or the sandbox's attempt has ended.
        BundleStoreError: the store failed (nothing recorded: the runner may retry).
    """
    with db.session() as session:
        _running_item(session, item_id, sandbox_id)  # an ended attempt fails nothing
    try:
        with open(upload.path, "rb") as source:
            contents = read_bundle(source, bundle_limits(settings))
    except BundleError as error:
        _fail_item(db, item_id, sandbox_id, error, actor=actor)
        raise
    inline = upload.size <= settings.bundle_inline_max_bytes
    # Each upload its own key (by its content): a later upload never rewrites the object a
    # stored row describes; the row moves to the new one in the transaction that checks the
    # item still runs, and the object it leaves is deleted after the commit.
    key = f"{item_id}-{upload.sha256[:32]}.tar.gz"
    with db.session() as session:
        _running_item(session, item_id, sandbox_id)  # before any write to the store
    if not inline:
        with open(upload.path, "rb") as source:
            store.put(key, source)
    data = None
    if inline:
        with open(upload.path, "rb") as source:
            data = source.read()
    where = (store, key, data)
    review, replaced = _record(
        db, item_id, upload, contents, where, sandbox_id=sandbox_id, actor=actor
    )
    if replaced is not None and replaced != key:
        _delete_quietly(store, replaced)
    return review


def _record(
    db: Database,
    item_id: str,
    upload: Upload,
    contents: Any,
    where: tuple[BundleStore, str, bytes | None],
    *,
    sandbox_id: str | None,
    actor: str,
) -> tuple[BundleReview, str | None]:
    """Write the bundle's row (the item locked and still running); its review state and the
    store key of the object it described before, if any."""
    store, key, data = where
    with db.session() as session:
        item = _running_item(session, item_id, sandbox_id)
        review = BundleReview.NOT_REQUIRED
        request = stored_request(db.sealer.open(item.payload, item.org_id, item.id))
        if request.review.required and contents.manifest.entries:
            review = BundleReview.REVIEW_REQUESTED
        row = session.get(WorkItemBundle, item_id) or WorkItemBundle(work_item_id=item_id)
        before, replaced = row.review, row.location
        row.org_id, row.size_bytes, row.sha256 = item.org_id, upload.size, upload.sha256
        row.content_bytes, row.changes = contents.content_bytes, len(contents.manifest.entries)
        row.refused, row.data = len(contents.manifest.refused), data
        row.store, row.location = (DATABASE, None) if data is not None else (store.name, key)
        session.add(row)
        counts = contents.counts()
        detail = (
            f"{counts['add']} added, {counts['modify']} modified, {counts['delete']} deleted; "
            f"{contents.content_bytes} bytes; {row.refused} refused"
        )
        bundle_transition(session, row, review, actor=actor, detail=detail, from_state=before)
    return review, replaced


def _delete_quietly(store: BundleStore, key: str) -> None:
    try:
        store.delete(key)
    except Exception:  # an object left over costs space, not correctness
        log.warning("could not delete a replaced bundle object", extra={"key": key})


def _running_item(session: Session, item_id: str, sandbox_id: str | None) -> WorkItem:
    item = session.get(WorkItem, item_id, with_for_update=True)
    if item is None:
        raise LookupError(f"work item {item_id} does not exist")
    if item.state != ItemState.RUNNING:
        raise BundleStateError(f"work item is {item.state}: a bundle comes while it runs")
    sandbox = session.get(Sandbox, sandbox_id) if sandbox_id is not None else None
    if sandbox is not None and sandbox.attempt != item.attempts:
        raise BundleStateError("this sandbox's attempt has ended: the item moved on")
    return item


def _fail_item(
    db: Database, item_id: str, sandbox_id: str | None, error: CorralError, *, actor: str
) -> None:
    """Fail the item for its refused bundle, if the attempt that sent it still runs: the
    item may have moved on to another attempt while the upload was read."""
    with db.session() as session:
        try:
            item = _running_item(session, item_id, sandbox_id)
        except (LookupError, BundleStateError):
            return
        item.error_code, item.error_message = error.code, f"the result bundle was refused: {error}"
        transition(session, item, ItemState.FAILED, actor=actor, detail=error.code)


def open_bundle(db: Database, store: BundleStore, item_id: str) -> tuple[dict[str, Any], BinaryIO]:
    """The bundle's view and a stream of its archive; the caller closes the stream.

    Raises:
        LookupError: the item has no bundle.
        BundleStoreError: the store cannot be read.
    """
    with db.session() as session:
        row = session.get(WorkItemBundle, item_id)
        if row is None or row.review == BundleReview.DISCARDED:
            raise LookupError(f"work item {item_id} has no result bundle")
        view = bundle_view(row)
        data, location = row.data, row.location
    if data is not None:
        return view, io.BytesIO(data)
    assert location is not None
    return view, store.open(location)


def review_bundle(
    db: Database, item_id: str, decision: BundleReview, *, sha256: str, actor: str
) -> str:
    """Accept or reject the bundle held for review; the review it has now. ``sha256`` names
    the bundle the reviewer saw (the download's digest). The same decision again answers the
    same; any other change is refused.

    The item is locked, then the bundle (the order an upload takes), and both checks are made
    in the transaction that writes the decision: no upload comes between them.

    Raises:
        LookupError: the item has no bundle.
        ItemRunningError: the item has not ended (its runner may still replace the bundle,
            or its attempt fail and the bundle be discarded).
        BundleChangedError: the bundle is not the one ``sha256`` names.
        BundleStateError: it is not waiting for review (not required, or decided otherwise).
    """
    assert decision in DECISIONS
    with db.session() as session:
        item = session.get(WorkItem, item_id, with_for_update=True)
        row = session.get(WorkItemBundle, item_id, with_for_update=True) if item else None
        if item is None or row is None:
            raise LookupError(f"work item {item_id} has no result bundle")
        if not ItemState(item.state).is_final:
            raise ItemRunningError(
                f"work item is {item.state}: its bundle is reviewed once the item has ended"
            )
        if row.sha256 != sha256.lower():
            # Neither digest is quoted: a client must download the bundle to learn it.
            raise BundleChangedError(
                "the bundle changed since the one reviewed (its sha256 is not the one given): "
                "download it again and review that"
            )
        if row.review == decision:
            return row.review
        if row.review != BundleReview.REVIEW_REQUESTED:
            raise BundleStateError(f"the bundle is {row.review}: only review_requested changes")
        bundle_transition(session, row, decision, actor=actor, from_state=row.review)
        return decision.value


def bundle_view(row: WorkItemBundle) -> dict[str, Any]:
    return {
        "review": row.review,
        "changes": row.changes,
        "refused": row.refused,
        "content_bytes": row.content_bytes,
        "size_bytes": row.size_bytes,
        "sha256": row.sha256,
        "store": row.store,
        "reviewed_by": row.reviewed_by,
        "reviewed_at": row.reviewed_at.isoformat() if row.reviewed_at else None,
        "created_at": row.created_at.isoformat() if row.created_at else None,
    }


def load_bundle_view(session: Session, item_id: str) -> dict[str, Any] | None:
    row = session.get(WorkItemBundle, item_id)
    return None if row is None else bundle_view(row)


def bundle_events(session: Session, item_id: str) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(LifecycleEvent)
        .where(LifecycleEvent.work_item_id == item_id, LifecycleEvent.entity == "bundle")
        .order_by(LifecycleEvent.id)
    )
    return [
        {"from": r.from_state, "to": r.to_state, "actor": r.actor, "at": r.created_at.isoformat()}
        for r in rows
    ]
