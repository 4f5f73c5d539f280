"""Keep the server's CPUs out of idle while requests flow (``blockflow serve --warm-cores-ms MS``).

At low load every block process sleeps between requests, and each step of a task's ensemble
wakes threads on cores that were idle. In a VM an idle vCPU halts and gives its core back to
the host, so each wake-up costs an exit to the hypervisor and then a cold core; on an H100
machine (16 vCPUs under KVM) that made one ensemble step cost 0.43-0.48 ms with idle cores
against 0.19 ms with none (docs/performance.md; docs/triton-notes.md, *An ensemble step is a chain of thread
and process wake-ups*).

This does in user space what guest halt polling (``cpuidle_haltpoll``) or ``idle=poll`` do in
the kernel: one poller process per CPU the server may use, pinned to it at ``SCHED_IDLE``
priority, busy-loops while a block has started an ``execute`` of one request within the last
``window_ms`` and none of several requests (the server's activity stamp,
:mod:`blockflow.core.activity`), and otherwise sleeps, checking the stamp every
:data:`IDLE_POLL_S`. A call of several requests means requests wait in a queue: the server is
bound by its throughput, not by wake-ups, and its threads keep the CPUs busy themselves. There
pollers that spun after every call gained nothing and cost throughput (2-19% at concurrency 32,
docs/deploy.md, *The host under the server*), so they stand down until calls hold one
request again. A ``SCHED_IDLE`` thread gives way to any other thread at
once, so it takes no CPU time from the server; what it changes is that a core running it never
halts. The price is CPU time: while requests come closer together than the window, every CPU
of the server is busy (shown as 100% in ``top``); after the window it costs ~0.5% of a core per
poller. The first request after a quiet spell still meets idle cores (the pollers see the stamp
within :data:`IDLE_POLL_S`).

Not for a server with a CPU quota (a container's ``--cpus``, a cgroup's ``cpu.max``): the
pollers' time counts against the quota, so they would throttle the server itself. :meth:`start`
refuses then. On hosts with SMT, a poller shares its core with its sibling thread's work;
measure before keeping it on (``blockflow bench --warm-cores-ms``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from blockflow.core import env
from blockflow.core.activity import ActivityStamp
from blockflow.core.errors import EnvironmentProblem
from blockflow.triton.process_group import die_with_parent

# How often a poller outside the window looks at the stamp: 100 wake-ups a second, ~0.5% of a core
# (measured with /proc/PID/schedstat on the 2-core development machine).
IDLE_POLL_S = 0.01
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> str | None:
    """The CPU bandwidth limit this process runs under, as the cgroup file says it, or ``None``.

    Looks at this process's cgroup and every one above it, in cgroup v2 (``cpu.max``) and in
    v1's ``cpu`` controller (``cpu.cfs_quota_us``).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2 (alone, or beside v1 under unified/)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            found = _walk_up(base, path, "cpu.max", lambda text: text.split()[0] != "max")
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            found = _walk_up(base, path, "cpu.cfs_quota_us", lambda text: int(text) > 0)
        else:
            continue
        if found is not None:
            return found
    return None


def _walk_up(base: Path, path: str, name: str, limited: Callable[[str], bool]) -> str | None:
    """``name`` in the cgroup at ``path`` under ``base`` or above it, where ``limited`` says it limits."""
    d = base / path.lstrip("/")
    while True:
        try:
            text = (d / name).read_text().strip()
            if limited(text):
                return f"{d / name}: {text}"
        except (OSError, ValueError):
            pass
        if d == base or base not in d.parents:
            return None
        d = d.parent


class WarmCores:
    """One poller process per CPU in ``cpus`` (default: the CPUs this process may run on).

    ``stamp``: the activity stamp the pollers follow, spinning for ``window_ms`` after each
    call of one request unless a call of several came within it; ``None`` spins all the time (the *warm-cpus*
    condition of ``blockflow.bench.lab.ensemble_floor``).
    """

    def __init__(self, stamp: Path | None, window_ms: float = 0.0, cpus: Iterable[int] | None = None) -> None:
        self.stamp = stamp
        self.window_ms = window_ms
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> Mapping[str, str]:
        """What a block process needs in its environment to touch the stamp."""
        return {env.ACTIVITY_FILE: str(self.stamp)} if self.stamp is not None else {}

    def start(self, timeout: float = 30.0) -> None:
        """Start the pollers; returns once each runs at ``SCHED_IDLE`` on its CPU, or raises ``EnvironmentProblem``."""
        self.stop()  # a server started again keeps one poller per CPU
        quota = cpu_quota()
        if quota is not None:
            raise EnvironmentProblem(f"--warm-cores-ms: this process has a CPU quota ({quota}); the pollers' busy "
                                     "time would count against it and throttle the server. Serve without it here")
        if self.stamp is not None:
            ActivityStamp.create(self.stamp)
        args = ["--parent", str(os.getpid())]
        if self.stamp is not None:
            args += ["--stamp", str(self.stamp), "--window-ms", str(self.window_ms)]
        try:
            for cpu in self.cpus:
                self.processes.append(subprocess.Popen([sys.executable, "-m", __name__, "--cpu", str(cpu), *args],
                                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.PIPE, preexec_fn=die_with_parent))
            self._wait_running(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_running(self, deadline: float) -> None:
        waiting = list(self.processes)
        while waiting:
            proc = waiting[0]
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise EnvironmentProblem(f"a warm-core poller exited at start ({proc.returncode}): {err[-300:]}")
            try:
                if os.sched_getscheduler(proc.pid) == os.SCHED_IDLE:
                    waiting.pop(0)
                    continue
            except OSError:
                continue  # exited between the two calls: poll() says so next
            if time.monotonic() > deadline:
                raise EnvironmentProblem("the warm-core pollers did not start in time")
            time.sleep(0.01)

    def stop(self) -> None:
        for proc in self.processes:
            proc.kill()
        for proc in self.processes:
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        self.processes = []


def spin(cpu: int, parent: int, stamp: Path | None, window_ms: float) -> None:
    """A poller's life (see the module's docstring); returns when ``parent`` is gone."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    clock = time.monotonic_ns
    if stamp is None:
        while os.getppid() == parent:
            for _ in range(1_000_000):
                pass
        return
    activity = ActivityStamp(stamp, writable=False)
    last, last_batched = activity.last, activity.last_batched
    window = int(window_ms * 1e6)

    def latency_bound() -> bool:
        now = clock()
        return now - last() < window and now - last_batched() >= window

    while os.getppid() == parent:
        while latency_bound():
            pass
        if not latency_bound():  # twice: one odd read does not send the core to sleep
            time.sleep(IDLE_POLL_S)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one warm-core poller (started by blockflow serve --warm-cores-ms)")
    ap.add_argument("--cpu", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True, help="exit once this process is gone")
    ap.add_argument("--stamp", type=Path, default=None, help="the activity stamp; without it, spin all the time")
    ap.add_argument("--window-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    try:
        spin(a.cpu, a.parent, a.stamp, a.window_ms)
    except OSError as exc:
        sys.exit(f"warm-core poller on CPU {a.cpu}: {exc}")


if __name__ == "__main__":
    main()
