"""The host's CPU a benchmark window costs per inference, read from ``/proc`` around it: Triton's own
threads, each model's block processes (all its instances), the nginx front door and the client
(perf_analyzer, a child of the bench that has exited by then).

A server whose split is bound by the host rather than the GPU (docs/performance.md, "Instances and
MPS") shows here where its cores go, in the same run and units as its throughput.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from blockflow.core.procfs import cpu_seconds, thread_cpu
from blockflow.triton.process_group import group_members, stubs_by_model
from blockflow.triton.server import TritonServer


def cpu_of(pids: Iterable[int]) -> dict[int, float]:
    """Each of ``pids``' CPU seconds so far (one gone meanwhile left out)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            out[pid] = cpu_seconds(pid)
    return out


@dataclass(frozen=True)
class HostCpu:
    """CPU seconds used so far, by process: ``server`` (tritonserver), ``blocks`` (each model's stubs, by
    pid), ``front_door`` (nginx and its workers, by pid) and ``client`` (the bench's waited-for children:
    perf_analyzer); ``threads``: the server's (``tritonserver``) and each model's processes' threads, by pid
    and kernel name (:func:`blockflow.core.procfs.thread_cpu`)."""

    server: float
    blocks: dict[str, dict[int, float]]
    front_door: dict[int, float]
    client: float
    threads: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)


def snapshot(server: TritonServer) -> HostCpu | None:
    """The server's and the client's CPU seconds now; None without a running server."""
    if server.process is None:
        return None
    pid = server.process.pid
    blocks = {model: cpu_of(pids) for model, pids in stubs_by_model(pid).items()}
    door = server.front_door.process if server.front_door is not None else None
    front = cpu_of(group_members(door.pid)) if door is not None else {}
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    threads = {"tritonserver": {pid: thread_cpu(pid)}} | {model: {p: thread_cpu(p) for p in pids} for model, pids in blocks.items()}
    return HostCpu(cpu_of([pid]).get(pid, 0.0), blocks, front, usage.ru_utime + usage.ru_stime, threads)


def _grown(before: dict[int, float], after: dict[int, float]) -> float:
    """The CPU seconds the processes alive at ``after`` used since ``before`` (all of it for one started since)."""
    return sum(max(0.0, t - before.get(p, 0.0)) for p, t in after.items())


def per_inference(before: HostCpu, after: HostCpu, inferences: int, own: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Milliseconds of CPU per inference between two snapshots: ``server``, ``front_door``, ``client``,
    ``blocks`` (per model), ``own_blocks`` (the models in ``own``: what the run measured), the
    ``total`` and ``threads``: the server's and each model's (all its processes) by thread name, the busy
    ones (≥ 0.001 ms). A process that ended within the window is left out, one that started counts whole;
    so do threads (of a name, the live ones' growth: a thread that ended takes its time with it)."""
    def ms(seconds: float) -> float:
        return round(1000.0 * max(0.0, seconds) / inferences, 4)

    blocks = {m: ms(_grown(before.blocks.get(m, {}), pids)) for m, pids in sorted(after.blocks.items())}
    out: dict[str, Any] = {"server": ms(after.server - before.server), "front_door": ms(_grown(before.front_door, after.front_door)),
                           "client": ms(after.client - before.client), "blocks": blocks,
                           "own_blocks": round(sum(v for m, v in blocks.items() if m in own), 4)}
    out["total"] = round(out["server"] + out["front_door"] + out["client"] + sum(blocks.values()), 4)
    threads = {}
    for who, pids in sorted(after.threads.items()):
        grown: dict[str, float] = {}
        for pid, names in pids.items():
            was = before.threads.get(who, {}).get(pid, {})
            for name, t in names.items():
                grown[name] = grown.get(name, 0.0) + max(0.0, t - was.get(name, 0.0))
        if busy := {n: v for n, t in sorted(grown.items()) if (v := ms(t)) >= 0.001}:
            threads[who] = busy
    out["threads"] = threads
    return out


def busiest_threads(cpu: dict[str, Any] | None, top: int = 5) -> str:
    """A report cell: the ``top`` busiest threads of :func:`per_inference`'s ``threads``, each as
    ``process-kind thread ms`` (``tritonserver``'s own, or a model's), busiest first."""
    if not cpu or not cpu.get("threads"):
        return "—"
    ranked = sorted(((ms, who, name) for who, names in cpu["threads"].items() for name, ms in names.items()), reverse=True)
    return "; ".join(f"{who} {name} {ms:.3f}" for ms, who, name in ranked[:top])
