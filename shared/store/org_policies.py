"""What the deployment lets an org's work ask for: the images its items may name of their
own (``image``) and the regions they may ask for (``region``). Routing enforces both, before
any pool is chosen (:mod:`corral.scheduler.placement`); only the deployment admin changes
them (docs/operations.md: what an org may change).

An org without a row, or a column left null, gets the deployment's default: the image
patterns of ``CORRAL_ITEM_IMAGES`` (none by default: an item runs its pool's image), and
any region. A pattern is a glob (``*`` also matches ``/``) matched against the image's full
reference: ``ubuntu:24.04`` is ``docker.io/library/ubuntu:24.04``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from corral.shared.settings import split_list
from corral.shared.store.db import utcnow
from corral.shared.store.models import OrgPolicy

MAX_PATTERNS = 100
MAX_PATTERN_LENGTH = 512

# The image reference grammar of the distribution project (github.com/distribution/reference):
# [domain[:port]/]path[:tag][@digest], path components lower case.
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"(?P<name>(?:(?P<domain>{_DOMAIN})/)?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>\w[\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?"
)


def full_reference(reference: str) -> str | None:
    """``reference`` with the registry and namespace an engine fills in (``ubuntu`` is
    ``docker.io/library/ubuntu``); None when it is not an image reference."""
    found = _REFERENCE.fullmatch(reference)
    if found is None or len(reference) > 255 + 128 + 80:
        return None
    name = found["name"]
    first, _, rest = name.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"):
        # No registry named: Docker Hub, and a one-part name is in its library.
        if re.fullmatch(_COMPONENT, first) is None:
            return None  # then its first part is a path's, in lower case
        name = f"docker.io/{name}" if rest else f"docker.io/library/{name}"
    tail = reference[found.end("name") :]
    return name + tail


@dataclass(frozen=True)
class Policy:
    """One org's effective policy: image patterns, and region patterns (None: any)."""

    item_images: tuple[str, ...] = ()
    regions: tuple[str, ...] | None = None

    def image_refusal(self, image: str) -> str | None:
        """Why the org's item may not name ``image``; None when it may."""
        full = full_reference(image)
        if full is None:
            return "not an image reference ([registry/]name[:tag][@digest], lower-case name)"
        if not self.item_images:
            return "this org's items may not name an image of their own"
        if any(fnmatchcase(full, pattern) for pattern in self.item_images):
            return None
        return "not among the images this org's items may name"

    def region_allowed(self, region: str) -> bool:
        return self.regions is None or any(fnmatchcase(region, p) for p in self.regions)


def effective(stored: tuple[Any, Any] | None, default_images: str) -> Policy:
    """The policy of an org whose row holds ``stored`` (item_images, regions), or none."""
    images, regions = stored if stored is not None else (None, None)
    return Policy(
        item_images=tuple(images) if images is not None else split_list(default_images),
        regions=tuple(regions) if regions is not None else None,
    )


def stored_of(session: Session, orgs: Collection[str]) -> dict[str, tuple[Any, Any]]:
    """The stored policies of ``orgs`` that have one: (item_images, regions)."""
    if not orgs:
        return {}
    rows = session.execute(
        select(OrgPolicy.org_id, OrgPolicy.item_images, OrgPolicy.regions).where(
            OrgPolicy.org_id.in_(sorted(orgs))
        )
    )
    return {org: (images, regions) for org, images, regions in rows}


def check_patterns(field: str, patterns: Iterable[str]) -> list[str]:
    """``patterns`` as stored: each printable, bounded, none empty.

    Raises:
        ValueError: what is wrong, naming ``field``.
    """
    found = [pattern.strip() for pattern in patterns]
    if len(found) > MAX_PATTERNS:
        raise ValueError(f"{field}: at most {MAX_PATTERNS} patterns")
    for pattern in found:
        if not pattern or len(pattern) > MAX_PATTERN_LENGTH or not pattern.isprintable():
            raise ValueError(
                f"{field}: each pattern is 1 to {MAX_PATTERN_LENGTH} printable characters"
            )
    return found


def set_policy(
    session: Session,
    org_id: str,
    *,
    item_images: list[str] | None,
    regions: list[str] | None,
) -> None:
    """Set ``org_id``'s policy (a None column: the deployment's default; both None: the row
    goes).

    Raises:
        ValueError: a pattern list is invalid.
    """
    images = None if item_images is None else check_patterns("item_images", item_images)
    allowed = None if regions is None else check_patterns("regions", regions)
    if images is None and allowed is None:
        session.execute(delete(OrgPolicy).where(OrgPolicy.org_id == org_id))
        return
    row = session.get(OrgPolicy, org_id)
    if row is None:
        row = OrgPolicy(org_id=org_id)
        session.add(row)
    row.item_images, row.regions, row.updated_at = images, allowed, utcnow()


def policy_document(org_id: str, stored: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """How an org's stored policy reads (null: the deployment's default)."""
    images, regions = stored.get(org_id, (None, None))
    return {"org_id": org_id, "item_images": images, "regions": regions}
