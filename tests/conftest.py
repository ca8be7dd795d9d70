"""Shared fixtures. Every async test runs under a trio deadline (see ``deadline``)."""

from __future__ import annotations

import pytest
import trio

from flodl_trio import SessionSalt

TEST_SALT = SessionSalt(b"\x42" * 16)
# Generous for a loaded 2-core CI box; a hang still fails instead of blocking CI.
DEFAULT_DEADLINE_S = 30.0


@pytest.fixture
def salt() -> SessionSalt:
    return TEST_SALT


@pytest.fixture(autouse=True)
async def deadline(request: pytest.FixtureRequest):
    """Fail any async test that runs longer than its deadline instead of hanging."""
    marker = request.node.get_closest_marker("deadline")
    seconds = marker.args[0] if marker else DEFAULT_DEADLINE_S
    with trio.fail_after(seconds):
        yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deadline(seconds): trio deadline for this test")
