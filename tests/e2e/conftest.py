"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.e2e.machines import TwoMachines


@pytest.fixture
def two_machines() -> Iterator[TwoMachines]:
    machines = TwoMachines()
    try:
        machines.build()
    except (OSError, subprocess.CalledProcessError) as exc:
        machines.tear_down()
        pytest.fail(f"this test builds network namespaces (root and iproute2 needed): {exc}")
    try:
        yield machines
    finally:
        machines.tear_down()
