"""A runtime directory and TensorMQ key are made private or refused (blockflow.core.runtime_dir)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from blockflow.core import env
from blockflow.core.errors import EnvironmentProblem
from blockflow.core.runtime_dir import (
    MAX_CHARS,
    default_for,
    ensure_tensormq,
    locate,
    open_own,
    private_dir,
    read_key,
    temp_path,
    write_private_file,
)


def test_the_default_is_one_directory_per_user_and_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(env.RUNTIME_DIR, raising=False)
    a, b = tmp_path / "a", tmp_path / "b"
    assert default_for(a) == default_for(tmp_path / "x" / ".." / "a") != default_for(b)
    made = locate(a)
    assert made == default_for(a) and stat.S_IMODE(made.stat().st_mode) == 0o700
    assert locate(a) == made  # found again, as every block process of one server finds it


def test_a_named_directory_is_used_but_not_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.RUNTIME_DIR, str(tmp_path / "absent"))
    with pytest.raises(EnvironmentProblem, match="missing"):
        locate(tmp_path)


def test_a_directory_others_can_open_or_a_link_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(EnvironmentProblem, match="open to other users"):
        private_dir(open_dir)
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(EnvironmentProblem, match="not a directory"):
        private_dir(tmp_path / "link")


def test_a_path_too_long_for_a_unix_socket_is_refused_up_front(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * max(1, MAX_CHARS - len(str(tmp_path))))
    deep.mkdir(mode=0o700)
    with pytest.raises(EnvironmentProblem, match="too long"):
        ensure_tensormq(deep)


def _make_key(runtime: str) -> bytes:
    ensure_tensormq(Path(runtime))
    return read_key(Path(runtime))


def test_block_processes_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    runtime = private_dir(tmp_path / "rt")
    with mp.get_context("spawn").Pool(4) as pool:
        keys = pool.map(_make_key, [str(runtime)] * 8)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    key = runtime / env.TMQ_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert sorted(p.name for p in runtime.iterdir()) == sorted([env.TMQ_KEY_FILE, env.TMQ_DIR])  # no temporary key left


def test_a_key_others_can_read_is_refused(tmp_path: Path) -> None:
    runtime = private_dir(tmp_path / "rt")
    ensure_tensormq(runtime)
    (runtime / env.TMQ_KEY_FILE).chmod(0o644)
    with pytest.raises(EnvironmentProblem, match="mode 600"):
        read_key(runtime)


def test_a_private_file_is_written_whole_and_opened_only_as_ones_own(tmp_path: Path) -> None:
    target = tmp_path / "f"
    a, b = temp_path(target), temp_path(target)
    assert a != b  # one per writer, also two threads of a process
    assert all(re.fullmatch(rf"\.f\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", n.name) for n in (a, b))
    write_private_file(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    with pytest.raises(RuntimeError):  # a write that fails leaves the old file and no temporary one
        write_private_file(target, lambda f: (_ for _ in ()).throw(RuntimeError("no")))
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    with open_own(target, "file") as f:
        assert f.read() == b"new"
    target.chmod(0o620)
    with pytest.raises(EnvironmentProblem, match="mode 644 or narrower"):
        open_own(target, "file")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        open_own(tmp_path / "link", "file")


def test_two_threads_writing_one_file_each_leave_a_whole_one(tmp_path: Path) -> None:
    target = tmp_path / "f"
    bodies = [bytes([65 + i]) * 200_000 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda body: write_private_file(target, lambda f: [f.write(body[k:k + 1000]) for k in range(0, len(body), 1000)]), bodies))
    assert target.read_bytes() in bodies and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
