"""The api's processes: several only on a shared database (the real processes are in
tests/acceptance/test_api_processes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.scheduler.api.server import serve
from corral.shared.errors import ConfigurationError
from corral.shared.settings import CoreSettings


def test_several_processes_are_refused_on_the_embedded_database(tmp_path: Path) -> None:
    settings = CoreSettings(
        database_url=f"sqlite:///{tmp_path / 'corral.db'}",
        state_dir=tmp_path,
        api_port=0,
        api_processes=2,
    )
    with pytest.raises(ConfigurationError, match="CORRAL_API_PROCESSES=2 needs a shared"):
        serve(settings)
    assert list(tmp_path.iterdir()) == []  # refused before it bound or wrote anything
