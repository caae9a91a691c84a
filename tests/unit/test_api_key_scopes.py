"""What an org key's scopes hold: ``admin`` all, ``dispatch`` and ``review`` each ``read``,
and ``dispatch`` never ``review`` (the work's author is not its reviewer by default)."""

from __future__ import annotations

import pytest

from corral.scheduler.api.auth import EVERY_SCOPE, Scope
from corral.shared.store.api_keys import SCOPES, ApiKeyError, granted, parse_scopes


def test_dispatch_does_not_hold_review_and_review_holds_read() -> None:
    assert granted(["dispatch"]) == {"dispatch", "read"}
    assert granted(["review"]) == {"review", "read"}
    assert granted(["read"]) == {"read"}
    assert "review" not in granted(["dispatch", "read"])  # a key made before review


def test_admin_holds_every_scope_the_api_checks() -> None:
    assert granted(["admin"]) == set(SCOPES) == set(EVERY_SCOPE)
    assert Scope.REVIEW in EVERY_SCOPE  # the deployment admin token reviews


def test_review_is_a_scope_a_key_may_be_given() -> None:
    assert parse_scopes(["review", "dispatch", "review"]) == ["dispatch", "review"]
    with pytest.raises(ApiKeyError, match="dispatch, read, review, admin"):
        parse_scopes(["reviewer"])
