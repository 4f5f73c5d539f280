"""The warm-core pollers (``--warm-cores-ms``): real processes, real scheduling policy, real stamp."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from blockflow.core.activity import ActivityStamp
from blockflow.core.procfs import stat_fields
from blockflow.triton.warm_cores import WarmCores, cpu_quota


def cpu_seconds(pids: list[int]) -> float:
    """Time on a CPU, from the scheduler's own count (ns) where the kernel keeps it: utime and stime are
    sampled at clock ticks, which charges a whole 10 ms to a poller that happened to run at a tick (a
    0.5-s idle window once read 0.03 s for two pollers that ran for microseconds at a time)."""
    try:
        return sum(int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) for pid in pids) / 1e9
    except (OSError, ValueError, IndexError):
        fields = [stat_fields(pid) for pid in pids]  # utime and stime: proc(5)'s fields 14 and 15
        return sum(int(f[11]) + int(f[12]) for f in fields) / os.sysconf("SC_CLK_TCK")


def test_pollers_spin_only_inside_the_window(tmp_path: Path) -> None:
    stamp = tmp_path / "activity"
    warm = WarmCores(stamp, window_ms=300)
    warm.start()
    try:
        pids = [p.pid for p in warm.processes]
        assert len(pids) == len(os.sched_getaffinity(0))
        assert [os.sched_getaffinity(pid) for pid in pids] == [{cpu} for cpu in sorted(os.sched_getaffinity(0))]
        assert all(os.sched_getscheduler(pid) == os.SCHED_IDLE for pid in pids)
        assert stamp.stat().st_mode & 0o077 == 0 and ActivityStamp(stamp, writable=False).last() == 0
        time.sleep(0.3)  # past the interpreters' start
        before = cpu_seconds(pids)
        time.sleep(0.5)
        idle = cpu_seconds(pids) - before
        writer = ActivityStamp(stamp, writable=True)
        before = cpu_seconds(pids)
        for _ in range(10):  # requests flowing: a touch every 50 ms
            writer.touch()
            time.sleep(0.05)
        busy = cpu_seconds(pids) - before
        assert ActivityStamp(stamp, writable=False).last() > 0
        before = cpu_seconds(pids)
        for i in range(10):  # under load: calls of one request among calls of several
            writer.touch(requests=1 if i % 2 else 4)
            time.sleep(0.05)
        batched = cpu_seconds(pids) - before
        assert ActivityStamp(stamp, writable=False).last_batched() > 0
        # Outside the window a poller wakes 100 times a second for microseconds; inside it, it
        # takes every idle moment of its CPU (at SCHED_IDLE: what the rest of the machine leaves);
        # while calls batch, it stands down.
        assert idle <= 0.03, idle
        assert busy >= 0.3 * len(pids) * 0.5, busy
        assert batched <= 0.03, batched
    finally:
        warm.stop()
    assert warm.processes == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_a_stamp_is_never_read_half_written(tmp_path: Path) -> None:
    """A reader in a tight loop, as a poller is, sees only whole stamps while another process writes."""
    stamp = tmp_path / "activity"
    ActivityStamp.create(stamp)
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from blockflow.core.activity import ActivityStamp
        s = ActivityStamp(Path({str(stamp)!r}), writable=True)
        s.touch()
        print("ready", flush=True)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            s.touch()
    """)
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    reader = ActivityStamp(stamp, writable=False)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        seen, reads = reader.last(), 0
        while writer.poll() is None:
            now = reader.last()
            assert now >= seen, f"a stamp went back in time: {seen} then {now}"  # a torn write reads as an older time
            seen, reads = now, reads + 1
        assert reads > 10_000
    finally:
        writer.kill()
        writer.wait()
        reader.close()


def test_pollers_end_with_the_process_that_started_them(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from blockflow.triton.warm_cores import WarmCores
        w = WarmCores(Path({str(tmp_path / 'activity')!r}), window_ms=10)
        w.start()
        print(" ".join(str(p.pid) for p in w.processes), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids and all(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "warm-core pollers outlived the server's owner"


def _alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def _cgroups(tmp_path: Path, lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc = tmp_path / "cgroup"
    proc.write_text(lines)
    root = tmp_path / "sys"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


@pytest.mark.parametrize(("lines", "files", "found"), [
    # cgroup v2: a limit on an ancestor counts
    ("0::/kubepods/pod1/ctr\n", {"cgroup.controllers": "cpu", "kubepods/pod1/cpu.max": "200000 100000\n",
                                 "kubepods/pod1/ctr/cpu.max": "max 100000\n"}, "kubepods/pod1/cpu.max: 200000 100000"),
    ("0::/user.slice\n", {"cgroup.controllers": "cpu", "user.slice/cpu.max": "max 100000\n"}, None),
    # v1 beside v2 (v2 mounted at unified/)
    ("4:cpu,cpuacct:/docker/abc\n0::/\n", {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n"},
     "docker/abc/cpu.cfs_quota_us: 150000"),
    ("4:cpu,cpuacct:/\n0::/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "unified/cgroup.procs": ""}, None),
])
def test_cpu_quota_is_found_in_either_cgroup_version(tmp_path: Path, lines: str, files: dict[str, str], found: str | None) -> None:
    proc, root = _cgroups(tmp_path, lines, files)
    got = cpu_quota(proc, root)
    if found is None:
        assert got is None
    else:
        assert got is not None and got.endswith(found)
