"""The runner keeps back a result over the claim's limit and says why, instead of sending a
body the api would refuse (which used to end the item as sandbox_lost)."""

from __future__ import annotations

import pytest

from corral.runner.errors import ProtocolError
from corral.runner.protocol import DEFAULT_MAX_RESULT_BYTES, Completion, parse_claim

CLAIM = {"work_item_id": "wi-1", "work": {"kind": "shell", "command": "true"}}


def test_a_result_within_the_limit_is_sent_as_it_is() -> None:
    done = Completion(0, "work", result={"n": 1})
    assert done.within(100) is done
    assert "error_code" not in done.to_json() and done.succeeded


def test_a_result_over_the_limit_is_kept_back_with_the_sizes_named() -> None:
    done = Completion(0, "work", result="x" * 200).within(100)
    assert done.result is None and done.error_code == "result_too_large"
    assert not done.succeeded
    assert (
        done.error is not None and "202 bytes of JSON" in done.error and "100 bytes" in done.error
    )
    assert done.to_json()["error_code"] == "result_too_large"


def test_the_claim_says_the_limit_and_an_older_claim_gets_the_default() -> None:
    assert parse_claim({**CLAIM, "max_result_bytes": 5000}).max_result_bytes == 5000
    assert parse_claim(CLAIM).max_result_bytes == DEFAULT_MAX_RESULT_BYTES
    for bad in (0, -1, "big", True, 1.5):
        with pytest.raises(ProtocolError, match="max_result_bytes"):
            parse_claim({**CLAIM, "max_result_bytes": bad})
