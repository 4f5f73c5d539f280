"""blockflow.triton.mps: a clear error where the MPS control binary is missing, and the client environment."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from blockflow.core.errors import EnvironmentProblem
from blockflow.triton.mps import MpsDaemon


def test_missing_control_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing named nvidia-cuda-mps-control here
    daemon = MpsDaemon(tmp_path / "mps")
    with pytest.raises(EnvironmentProblem, match="nvidia-cuda-mps-control"):
        daemon.start()
    daemon.stop()  # nothing started: a no-op


def test_daemon_gets_private_directories_and_is_told_to_quit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in control binary that records how it was called (the real one needs a GPU driver).
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    fake = bindir / "nvidia-cuda-mps-control"
    fake.write_text(f'#!/bin/sh\necho "$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat -)" >> {calls}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    daemon = MpsDaemon(tmp_path / "rt" / "mps")
    daemon.start()
    assert daemon.pipe_dir.is_dir() and stat.S_IMODE(daemon.pipe_dir.stat().st_mode) == 0o700
    assert daemon.env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.pipe_dir)
    daemon.stop()
    daemon.stop()  # once only
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("-d ") and f"pipe={daemon.pipe_dir}" in lines[0]
    assert "stdin=quit" in lines[1] and f"pipe={daemon.pipe_dir}" in lines[1]
