"""What one ensemble step costs with no block work at all: the floor under a TensorMQ hop.

A Python-backend model that only copies its 256-byte input (a ticket's size) to its output is
served alone and as ensembles of 1 and 4 such steps, each step its own model (its own stub
process, as blocks are), on one real ``tritonserver``; perf_analyzer measures each at
concurrency 1, batch 1. The cost of one step is ``(p50(4 steps) - p50(1 step)) / 3``.

A step is a chain of thread and process wake-ups (ensemble callback, scheduler thread, model
instance thread, the stub through a shared-memory semaphore, back to the instance thread), so
what a wake-up costs on the machine makes up much of the floor. The models come with and
without Triton's dynamic batcher (blocks have it, delay 0: one wake-up more), and each is
measured under ``--conditions``, switched in turns on one server:

- ``free``: the server's threads may run on any CPU;
- ``cpus=LIST``: every thread of the server and its stubs pinned to LIST (a wake-up on a busy
  or the same CPU needs no inter-processor interrupt, which in a VM also costs a VM exit);
- ``warm-cpus``: one busy loop per CPU at ``SCHED_IDLE`` priority (any other thread preempts it at
  once; :mod:`blockflow.triton.warm_cores` without its window): no core ever idles, so a VM's vCPU
  never halts and gives its physical core back to the host between requests. It says how much of
  the floor is the cost of waking an idle core;
- ``cpu-latency``: this process holding ``/dev/cpu_dma_latency`` at 0, the kernel's PM QoS
  request that keeps cores out of deep C-states (needs root; no effect without a cpuidle driver).

Each combination is measured ``--repeats`` times, alternating, and reported as the median and
its spread. Triton's per-model statistics of the 4-step chain say where a step's time goes.

    python -m blockflow.bench.lab.ensemble_floor --out DIR [--conditions 'free;cpus=0;cpus=0-1;cpu-latency']
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import os
import statistics
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.bench.harness import commit, device_name, write_results
from blockflow.bench.host_cpu import cpu_of
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.bench.triton_stats import model_stats
from blockflow.triton.process_group import group_members
from blockflow.triton.server import ServerOptions, TritonServer
from blockflow.triton.warm_cores import WarmCores

TICKET = 256
STEPS = (1, 4)
COPY_MODEL_TEMPLATE = '''import json
import os
import sys
import threading
import time

import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

{python_work}

class TritonPythonModel:
    def initialize(self, args):
        self.laps_dir = json.loads(args["model_config"])["parameters"]["LAPS_DIR"]["string_value"]
        self.name = args["model_name"]
        self.laps = []

    def execute(self, requests):
        # Through DLPack and a new torch tensor, as a block hands its tickets over (a numpy output
        # came out empty between two KIND_GPU instances in an ensemble: python_backend r24.10, H100).
        out = [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
                   "OUT", to_dlpack(from_dlpack(pb_utils.get_input_tensor_by_name(r, "IN").to_dlpack()).clone()))])
               for r in requests]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        python_work()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        self.laps.append((time.monotonic(), t1 - t0, c1 - c0))
        return out

    def finalize(self):
        facts = {"threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count(),
                 "switch_interval_s": sys.getswitchinterval(), "trace": sys.gettrace() is not None,
                 "affinity": len(os.sched_getaffinity(0)), "nice": os.nice(0), "python": sys.version.split()[0]}
        with open(os.path.join(self.laps_dir, self.name + ".json"), "w") as f:
            json.dump({"facts": facts, "laps": self.laps}, f)
'''


def python_work() -> int:
    """A fixed piece of pure Python (~10 µs on a warm core): dict, list and attribute work like a
    block's slot bookkeeping. Timed inside each copy model and in this process, to compare."""
    table: dict[int, list[int]] = {}
    total = 0
    for i in range(64):
        table.setdefault(i & 7, []).append(i)
        total += len(table[i & 7]) + i.bit_length()
    return total


def copy_model() -> str:
    """The copy model's source, with :func:`python_work` inlined (the stub imports nothing of the bench)."""
    return COPY_MODEL_TEMPLATE.replace("{python_work}", inspect.getsource(python_work))


def _copy_config(name: str, batching: bool, laps_dir: Path) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=32)
    cfg.input.add(name="IN", data_type=mc.TYPE_UINT8, dims=[TICKET])
    cfg.output.add(name="OUT", data_type=mc.TYPE_UINT8, dims=[TICKET])
    cfg.instance_group.add(count=1)
    if batching:
        cfg.dynamic_batching.max_queue_delay_microseconds = 0
    cfg.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "yes"
    cfg.parameters["LAPS_DIR"].string_value = str(laps_dir)
    return cfg


def _chain_config(name: str, steps: list[str]) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=32)
    cfg.input.add(name="IN", data_type=mc.TYPE_UINT8, dims=[TICKET])
    cfg.output.add(name="OUT", data_type=mc.TYPE_UINT8, dims=[TICKET])
    for i, model in enumerate(steps):
        step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        step.input_map["IN"] = "IN" if i == 0 else f"t{i}"
        step.output_map["OUT"] = "OUT" if i == len(steps) - 1 else f"t{i + 1}"
    return cfg


def _name(batching: bool) -> str:
    return "db" if batching else "nodb"


def write_repository(repo: Path, laps_dir: Path) -> list[str]:
    """The copy models (4 per batching setting) and their chains; returns what perf_analyzer measures."""
    measured = []
    for batching in (True, False):
        b = _name(batching)
        copies = [f"copy_{b}_{i}" for i in range(max(STEPS))]
        configs = [_copy_config(n, batching, laps_dir) for n in copies]
        configs += [_chain_config(f"chain{k}_{b}", copies[:k]) for k in STEPS]
        for cfg in configs:
            d = repo / cfg.name
            (d / "1").mkdir(parents=True)
            (d / "config.pbtxt").write_text(text_format.MessageToString(cfg))
            if cfg.backend == "python":
                (d / "1" / "model.py").write_text(copy_model())
        measured += [copies[0]] + [f"chain{k}_{b}" for k in STEPS]
    return measured


def parse_cpus(spec: str) -> set[int]:
    """``0-3,8`` as a set of CPU numbers."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin(pgid: int, cpus: set[int]) -> None:
    """Every thread of the server's processes (tritonserver and its stubs) onto ``cpus``."""
    for pid in group_members(pgid):
        with contextlib.suppress(OSError):  # a thread may end while we walk them
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def condition(name: str, pgid: int, all_cpus: set[int]) -> Iterator[bool]:
    """The server under one condition (see the module's docstring); yields whether it could be set."""
    if name == "free":
        pin(pgid, all_cpus)
        yield True
    elif name.startswith("cpus="):
        pin(pgid, parse_cpus(name[len("cpus="):]))
        try:
            yield True
        finally:
            pin(pgid, all_cpus)
    elif name == "warm-cpus":
        spinners = WarmCores(None, cpus=all_cpus)
        spinners.start()
        try:
            yield True
        finally:
            spinners.stop()
    elif name == "cpu-latency":
        try:
            f = open("/dev/cpu_dma_latency", "wb", buffering=0)  # noqa: SIM115  # held across the yield
        except OSError:
            yield False
            return
        try:
            f.write(struct.pack("i", 0))
            yield True
        finally:
            f.close()
    else:
        raise ValueError(f"unknown condition {name!r}: free, cpus=LIST, warm-cpus or cpu-latency")


def _check(server: TritonServer, models: list[str]) -> None:
    """Every measured model gives back its input, byte for byte."""
    x = np.arange(TICKET, dtype=np.uint8)[None]
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    try:
        for model in models:
            inp = httpclient.InferInput("IN", list(x.shape), "UINT8")
            inp.set_data_from_numpy(x)
            out = client.infer(model, [inp]).as_numpy("OUT")
            if out is None or not np.array_equal(out, x):
                raise RuntimeError(f"{model} answered {None if out is None else out.shape} instead of its input")
    finally:
        client.close()


def _stats(url: str, models: list[str]) -> dict[str, dict[str, float]]:
    """Per-request queue and compute times (µs) of ``models`` since the server started."""
    return {name: {k: st[f"{k}_ns"] / max(st["requests"], 1) / 1e3 for k in ("queue", "compute_input", "compute_infer", "compute_output")}
            for name, st in model_stats(url).items() if name in models}


def local_python_laps(n: int, pause_s: float) -> dict[str, float]:
    """Median wall and thread-CPU µs of :func:`python_work` in this process, ``pause_s`` asleep between calls."""
    walls, cpus = [], []
    for _ in range(n):
        if pause_s:
            time.sleep(pause_s)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        python_work()
        walls.append(time.perf_counter_ns() - t0)
        cpus.append(time.thread_time_ns() - c0)
    return {"wall_us": statistics.median(walls) / 1e3, "cpu_us": statistics.median(cpus) / 1e3, "n": n}


def idle_cpu(pgid: int, seconds: float = 2.0) -> dict[str, float]:
    """CPU share each process of the idle server uses (a stub that spins shows here)."""
    before = cpu_of(group_members(pgid))
    time.sleep(seconds)
    after = cpu_of(group_members(pgid))
    names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in after if Path(f"/proc/{pid}/comm").exists()}
    return {f"{names.get(pid, '?')}[{pid}]": (after[pid] - before[pid]) / seconds for pid in after if pid in before}


def python_laps(laps_dir: Path, windows: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Median wall and thread-CPU µs of :func:`python_work` in the copy models, per measured window key."""
    by_key: dict[str, tuple[list[int], list[int]]] = {}
    facts: dict[str, Any] = {}
    for f in sorted(laps_dir.glob("*.json")):
        data = json.loads(f.read_text())
        facts[f.stem] = data["facts"]
        for stamp, wall, cpu in data["laps"]:
            for key, start, end in windows:
                if start <= stamp <= end:
                    walls, cpus = by_key.setdefault(key, ([], []))
                    walls.append(wall)
                    cpus.append(cpu)
    out: dict[str, Any] = {k: {"wall_us": statistics.median(w) / 1e3, "cpu_us": statistics.median(c) / 1e3, "n": len(w)}
                           for k, (w, c) in by_key.items()}
    out["facts"] = facts
    return out


def run(out: Path, seconds: float, repeats: int, conditions: list[str]) -> dict[str, Any]:
    repo = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    laps_dir = Path(tempfile.mkdtemp(prefix="bench-floor-laps-"))  # not in the repository: Triton would take it for a model
    measured = write_repository(repo, laps_dir)
    runs: dict[str, list[float]] = {}
    windows: list[tuple[str, float, float]] = []
    unavailable: set[str] = set()
    all_cpus = os.sched_getaffinity(0)
    with TritonServer(ServerOptions.on_free_ports([repo])) as server:
        assert server.process is not None
        _check(server, measured)
        for model in measured:  # warm-up, not recorded: the first requests of a model are slower
            perf_analyzer(server.http_url, model, f"IN:{TICKET}", 1, seconds / 2, concurrency=1)
        idle = idle_cpu(server.process.pid)
        for _, cond in itertools.product(range(repeats), conditions):
            with condition(cond, server.process.pid, all_cpus) as ok:
                if not ok:
                    unavailable.add(cond)
                    continue
                for model in measured:
                    start = time.monotonic()
                    r = perf_analyzer(server.http_url, model, f"IN:{TICKET}", 1, seconds, concurrency=1)
                    windows.append((f"{model}|{cond}", start, time.monotonic()))
                    if "error" in r:
                        raise RuntimeError(f"perf_analyzer on {model}: {r.get('message', r)}")
                    runs.setdefault(f"{model}|{cond}", []).append(r["p50_ms"])
        stats = _stats(server.http_url, [f"copy_{_name(b)}_{i}" for b in (True, False) for i in range(max(STEPS))])
        local = {}
        for cond in (c for c in conditions if c not in unavailable):
            with condition(cond, server.process.pid, all_cpus):
                local[f"hot, {cond}"] = local_python_laps(2000, 0.0)
                local[f"paused 1 ms, {cond}"] = local_python_laps(500, 0.001)
    rows = []
    for batching, cond in itertools.product((True, False), [c for c in conditions if c not in unavailable]):
        b = _name(batching)
        models = (("alone", f"copy_{b}_0"), *((f"chain{k}", f"chain{k}_{b}") for k in STEPS))
        p = {k: statistics.median(runs[f"{m}|{cond}"]) for k, m in models}
        spread = [(max(v) - min(v)) / statistics.median(v) for _, m in models if (v := runs[f"{m}|{cond}"])]
        rows.append({"batching": batching, "condition": cond, **{f"{k}_p50_ms": v for k, v in p.items()},
                     "step_ms": (p["chain4"] - p["chain1"]) / 3, "max_spread": max(spread)})
    result = {"meta": {"device": device_name(), "commit": commit(), "cpus": len(all_cpus), "seconds": seconds, "repeats": repeats,
                       "conditions": conditions, "unavailable": sorted(unavailable)},
              "rows": rows, "runs": runs, "stats_us": stats,
              "python_work": {"in_stub": python_laps(laps_dir, windows), "in_process": local}, "idle_cpu": idle}
    return write_results(out, result, report)


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [f"# Ensemble-step floor on {meta['device']} ({meta['cpus']} CPUs), commit {meta.get('commit', '?')}", "",
             f"perf_analyzer over HTTP, batch 1, concurrency 1, {meta['seconds']} s windows, median of {meta['repeats']} "
             "runs taken in turns (spread: the largest (max - min) / median of a row's figures). A step copies 256 bytes "
             "in a Python-backend model. Conditions: `free` (no affinity), `cpus=L` (every server thread pinned to L), "
             "`warm-cpus` (a SCHED_IDLE busy loop on every CPU: no core idles), "
             "`cpu-latency` (/dev/cpu_dma_latency held at 0)."
             + (f" Not available here: {', '.join(meta['unavailable'])}." if meta["unavailable"] else ""),
             "", "| dynamic batcher | condition | model alone p50 | 1-step ensemble p50 | 4-step ensemble p50 | one step | spread |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {'on' if r['batching'] else 'off'} | {r['condition']} | {r['alone_p50_ms']:.3f} ms | "
                     f"{r['chain1_p50_ms']:.3f} ms | {r['chain4_p50_ms']:.3f} ms | {r['step_ms']:.3f} ms | {r['max_spread']:.0%} |")
    lines += ["", "Triton's statistics per request of each copy model over the whole run (µs):", "",
              "| model | queue | compute input | compute infer | compute output |", "|---|---|---|---|---|"]
    for name, s in sorted(res["stats_us"].items()):
        lines.append(f"| {name} | {s['queue']:.0f} | {s['compute_input']:.0f} | {s['compute_infer']:.0f} | {s['compute_output']:.0f} |")
    lines += python_work_report(res)
    return "\n".join(lines) + "\n"


def python_work_report(res: dict[str, Any]) -> list[str]:
    """The pure-Python piece inside the stubs against the same piece in the bench's own process."""
    work = res.get("python_work")
    if not work:
        return []
    lines = ["", "The same pure-Python piece (`python_work`), timed in each copy model after its response is built, and "
             "in the bench's own process (back to back, and with 1 ms asleep before each call, as at concurrency 1); "
             "median µs of wall clock and of the thread's CPU time (wall well above CPU: the thread waited "
             "for the GIL or a core).", "", "| where | wall µs | CPU µs | calls |", "|---|---|---|---|"]
    for name, v in work["in_process"].items():
        lines.append(f"| bench process, {name} | {v['wall_us']:.1f} | {v['cpu_us']:.1f} | {v['n']} |")
    for key, v in sorted(work["in_stub"].items()):
        if key != "facts":
            lines.append(f"| stub, {key.replace('|', ', ')} | {v['wall_us']:.1f} | {v['cpu_us']:.1f} | {v['n']} |")
    facts = next(iter(work["in_stub"].get("facts", {}).values()), None)
    if facts:
        lines += ["", "A stub's process: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + "."]
    busy = {k: v for k, v in res.get("idle_cpu", {}).items() if v > 0.01}
    lines += ["", "CPU used by the idle server's processes over 2 s: "
              + (", ".join(f"{k} {v:.0%}" for k, v in sorted(busy.items())) if busy else "none above 1% of a core") + "."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conditions", default="free;cpus=0;cpus=0-1;cpus=0-3",
                    help="conditions separated by ';': free, cpus=LIST (e.g. cpus=0-1,4), warm-cpus, cpu-latency")
    args = ap.parse_args()
    print(report(run(args.out, args.seconds, args.repeats, args.conditions.split(";"))))


if __name__ == "__main__":
    main()
