"""Fixtures of the fleet tests: the tiny checkpoint of the server tests (one per session)."""

from tests.server.conftest import tiny_checkpoint  # noqa: F401
