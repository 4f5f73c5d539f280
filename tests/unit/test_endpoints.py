"""The endpoints file of `blockflow serve`: private, trusted only when it is, forgotten with its server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockflow.core import endpoints

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "run" / "endpoints.json"
    monkeypatch.setenv("BLOCKFLOW_ENDPOINTS", str(path))
    return path


def _mine(pid: int | None = None) -> endpoints.Endpoints:
    return endpoints.Endpoints("127.0.0.1:18700", "127.0.0.1:18701", "http://127.0.0.1:18702/metrics",
                               "http://127.0.0.1:18703", "/run/token", pid or os.getpid(), "plans/default.yaml")


def test_written_private_and_read_back(where: Path) -> None:
    assert endpoints.write(_mine()) == where
    assert where.stat().st_mode & 0o777 == 0o600 and where.parent.stat().st_mode & 0o777 == 0o700
    assert endpoints.read() == _mine()


def test_the_default_directory_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blockflow.core.errors import EnvironmentProblem

    monkeypatch.delenv("BLOCKFLOW_ENDPOINTS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "blockflow").mkdir(mode=0o755)
    (tmp_path / "blockflow").chmod(0o755)  # as if another user had made it first, open
    with pytest.raises(EnvironmentProblem, match="endpoints directory .* is open to other users.*chmod 700"):
        endpoints.write(_mine())
    (tmp_path / "blockflow").chmod(0o700)
    assert endpoints.write(_mine()) == tmp_path / "blockflow" / "endpoints.json"
    assert endpoints.read() == _mine()
    # A rewrite replaces the file whole (a new inode), and the next read sees the new addresses.
    endpoints.write(_mine(os.getppid()))
    assert endpoints.read() == _mine(os.getppid())
    assert [f.name for f in (tmp_path / "blockflow").iterdir()] == ["endpoints.json"]  # no temp file left


def test_a_file_others_could_write_or_of_a_dead_server_is_ignored(where: Path) -> None:
    endpoints.write(_mine())
    where.chmod(0o644)
    assert endpoints.read() is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    endpoints.write(_mine(gone.pid))
    assert endpoints.read() is None


def test_a_server_removes_only_its_own_file(where: Path) -> None:
    endpoints.write(_mine(os.getppid()))  # a later server's file
    endpoints.remove(os.getpid())
    assert where.exists()
    endpoints.remove(os.getppid())
    assert not where.exists()


def _blockflow(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKFLOW_")} | env
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True, text=True, cwd=ROOT, env=full,
                          timeout=120, check=False)


def test_a_server_that_does_not_answer_is_named_with_its_flag_and_variable(tmp_path: Path) -> None:
    from blockflow.triton.options import free_port

    nothing = f"127.0.0.1:{free_port()}"
    isolated = {"BLOCKFLOW_ENDPOINTS": str(tmp_path / "none.json")}
    res = _blockflow("infer", "cls_a", "--random", BLOCKFLOW_HTTP_URL=nothing, **isolated)
    assert res.returncode == 8 and "Traceback" not in res.stderr, res.stderr
    assert f"{nothing} is from $BLOCKFLOW_HTTP_URL (set --url or $BLOCKFLOW_HTTP_URL)" in res.stderr, res.stderr
    res = _blockflow("status", "--url", nothing, **isolated)
    assert res.returncode == 8 and "is from --url" in res.stderr and "(set --metrics-url or $BLOCKFLOW_METRICS_URL)" in res.stderr, res.stderr
    res = _blockflow("apply", "plans/default.yaml", "--dry-run", BLOCKFLOW_CONTROL_URL=f"http://{nothing}",
                     BLOCKFLOW_TOKEN="a-token-of-sixteen-chars", **isolated)
    assert res.returncode == 8 and "$BLOCKFLOW_CONTROL_URL" in res.stderr, res.stderr
    # Exit codes: 7 an invalid plan, 2 (click's) bad usage, both listed in --help.
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nname: x\n")
    assert _blockflow("validate", str(bad), **isolated).returncode == 7
    assert _blockflow("validate", **isolated).returncode == 2
    listing = _blockflow("--help", **isolated).stdout
    assert "7    the plan is invalid or cannot be read" in listing and "8    a server did not answer" in listing
