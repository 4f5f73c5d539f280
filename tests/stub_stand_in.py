"""Backend modules that need the Python backend's ``triton_python_backend_utils`` (a stub's own), imported
in a test process with a stand-in for it."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def with_pb_utils(monkeypatch: pytest.MonkeyPatch, module: str, **attributes: Any) -> Iterator[Any]:
    """``module`` imported with a ``triton_python_backend_utils`` holding ``attributes``; what imported the
    stand-in goes with it afterwards, so other tests import the real modules afresh."""
    fake = types.ModuleType("triton_python_backend_utils")
    for name, value in attributes.items():
        setattr(fake, name, value)
    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    try:
        yield importlib.import_module(module)
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("blockflow.backend"):
                del sys.modules[name]
