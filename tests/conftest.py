"""Shared fixtures. Every async test runs under a trio deadline (see ``deadline``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable

import pytest
import trio

from flodl_trio import SessionSalt

TEST_SALT = SessionSalt(b"\x42" * 16)
# Generous for a loaded 2-core CI box; a hang still fails instead of blocking CI.
DEFAULT_DEADLINE_S = 30.0


@pytest.fixture
def salt() -> SessionSalt:
    return TEST_SALT


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deadline(seconds): trio deadline for this async test")


def _under_deadline(test: Callable[..., Awaitable[None]], seconds: float) -> Callable[..., Awaitable[None]]:
    @functools.wraps(test)
    async def wrapper(**kwargs: object) -> None:
        with trio.fail_after(seconds):
            await test(**kwargs)

    return wrapper


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run every coroutine test inside ``trio.fail_after`` (a hang fails, it never blocks CI).

    ``@pytest.mark.deadline(seconds)`` overrides the default.
    """
    for item in items:
        func = getattr(item, "obj", None)
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(func):
            marker = item.get_closest_marker("deadline")
            item.obj = _under_deadline(func, marker.args[0] if marker else DEFAULT_DEADLINE_S)
