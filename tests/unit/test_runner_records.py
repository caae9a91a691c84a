"""The runner's record classes (corral.runner.records), and what its start-up imports."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.providers.local.isolation import base_python
from corral.runner import records
from corral.runner.control import Endpoint
from corral.runner.errors import ConfigurationError
from corral.runner.protocol import Registration
from corral.runner.records import FrozenRecordError, field, record, replace

RUNNER = Path(records.__file__).parent


@record
class Point:
    x: int
    y: int = 0
    tags: list[str] = field(default_factory=list)
    secret: str = field(default="s3cret", repr=False)


@record(frozen=False)
class Box:
    items: list[int] = field(default_factory=list)


@record
class Labelled(Point):
    label: str = "p"


def test_fields_are_taken_in_order_by_position_or_name_with_defaults() -> None:
    point = Point(1, tags=["a"])
    assert (point.x, point.y, point.tags, point.secret) == (1, 0, ["a"], "s3cret")
    assert Point(x=2, y=3) == Point(2, 3) != Point(2, 4)
    assert Point(1).tags is not Point(1).tags  # a factory is called for each record
    assert Labelled(1, 2, label="q").label == "q" and Labelled(1).y == 0


def test_a_wrong_call_is_refused_as_a_constructor_would() -> None:
    with pytest.raises(TypeError, match="missing field x"):
        Point()
    with pytest.raises(TypeError, match="no field"):
        Point(1, z=3)
    with pytest.raises(TypeError, match="x twice"):
        Point(1, x=2)
    with pytest.raises(TypeError, match="at most 4"):
        Point(1, 2, [], "s", 5)
    with pytest.raises(TypeError, match="without a default after one with"):

        @record
        class Wrong:
            a: int = 1
            b: int


def test_frozen_records_refuse_changes_hash_and_copy_with_replace() -> None:
    point = Point(1, 2)
    with pytest.raises(FrozenRecordError):
        point.x = 5  # type: ignore[misc]
    with pytest.raises(FrozenRecordError):
        del point.y
    assert hash(Point(1, 2, ("a",))) == hash(Point(1, 2, ("a",)))  # type: ignore[arg-type]
    moved = replace(point, y=7)
    assert (moved.x, moved.y, point.y) == (1, 7, 2)
    with pytest.raises(TypeError, match="no field"):
        replace(point, z=1)
    box = Box()
    box.items = [1]  # not frozen: assignable, and unhashable as a dataclass would be
    with pytest.raises(TypeError):
        hash(box)


def test_repr_leaves_out_the_fields_marked_so() -> None:
    assert repr(Point(1)) == "Point(x=1, y=0, tags=[])"
    shown = repr(Registration("tok-secret", "sb-1", "wi-1", 10.0))
    assert "tok-secret" not in shown and "sb-1" in shown


def test_the_runner_starts_without_dataclasses_inspect_or_typing() -> None:
    # What a sandbox's interpreter imports before the runner's first call: none of the
    # modules that made half of its start-up, nor urllib for a control URL on a socket.
    probe = (
        "import sys, runner.main, runner.control; "
        "runner.control.Endpoint.parse('unix:///run/corral/api.sock'); "
        "print(sorted(m for m in ('dataclasses', 'inspect', 'typing', 'ast', 'urllib.parse') "
        "if m in sys.modules))"
    )
    found = subprocess.run(
        [base_python(), "-S", "-c", probe],
        cwd=RUNNER.parent,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_a_control_socket_url_read_without_urllib_reads_as_urllib_reads_it(path: str) -> None:
    url = f"unix:///{path}"
    try:
        expected: Endpoint | str = Endpoint(scheme="unix", socket_path=_urlsplit_path(url))
    except ConfigurationError as error:
        expected = str(error)
    try:
        found: Endpoint | str = Endpoint.parse(url)
    except ConfigurationError as error:
        found = str(error)
    assert found == expected


def _urlsplit_path(url: str) -> str:
    """The socket path the control URL's parse gave through ``urlsplit`` alone."""
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/"):
        raise ConfigurationError(
            f"control URL {url!r}: a unix URL needs an absolute path, unix:///abs/path"
        )
    return parts.path
