"""Fixtures of the integration tests."""

from __future__ import annotations

from tests.integration.api_clients import make_client

__all__ = ["make_client"]
