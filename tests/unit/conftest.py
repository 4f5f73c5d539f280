"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from blockflow.core.runtime_dir import ensure_tensormq


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Path]:
    """A server's private runtime directory (0700) with TensorMQ's folder: sockets for the test's ends
    (test modules that need pools in /dev/shm too define their own)."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    ensure_tensormq(rt)
    yield rt
