"""What one block process costs in GPU memory inside Triton, step by step.

    python -m blockflow.bench.lab.stub_memory --out bench/results/h100 [--plan plans/bench_r50.yaml] [--models b0 r50__ref ...]

Starts a server with nothing loaded and ``BLOCKFLOW_TRACE_DIR`` set, then loads the given
models one at a time. For each it records the GPU's used memory before and after the load
(NVML), the stub process's and the server process's own NVML figures, and the stub's
trace of ``initialize`` (backend/trace.py): its memory at start (before any torch CUDA
call), after the CUDA context, the weights, the warm-up and graphs, the TensorMQ pools and
the monitor. Each model is unloaded, and its process gone, before the next one loads.

Repeats that under each ``--variant`` (server environment settings), so e.g. eager vs lazy
CUDA module loading can be compared in one run. Writes ``stub_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from blockflow.bench.nvml import GpuSampler
from blockflow.bench.timeline import read_traces
from blockflow.core.env import TRACE_DIR as TRACE_ENV
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan
from blockflow.triton.flags import CUDA_POOL_MB
from blockflow.triton.server import ServerOptions, TritonServer

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "lazy modules forced": {"CUDA_MODULE_LOADING": "LAZY"},
    "eager modules forced": {"CUDA_MODULE_LOADING": "EAGER"},
    "no CUDA graphs": {"BLOCKFLOW_DISABLE_CUDA_GRAPHS": "1"},
}


def _settle(gpus: GpuSampler, server: TritonServer, model: str, timeout: float = 60.0) -> None:
    """Wait until ``model`` has no stub process left and GPU memory stops moving."""
    deadline = time.monotonic() + timeout
    while model in server.stub_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    last = -1.0
    while time.monotonic() < deadline:
        now = gpus.memory_used_mib()[0] if gpus.available else 0.0
        if abs(now - last) < 1:
            return
        last = now
        time.sleep(1.0)


def measure(repo: Path, models: list[str], env: dict[str, str], cuda_pool_mb: int) -> list[dict[str, Any]]:
    trace = Path(tempfile.mkdtemp(prefix="bench-stubmem-"))
    gpus = GpuSampler()
    rows = []
    opts = ServerOptions.on_free_ports([repo], load=(),
                         cuda_pool_mb=cuda_pool_mb,
                         env={**env, TRACE_ENV: str(trace)})
    with TritonServer(opts) as server:
        assert server.process is not None
        server_pid = server.process.pid
        control = server.api()
        time.sleep(2)
        for model in models:
            before = gpus.memory_used_mib()[0] if gpus.available else 0.0
            server_before = gpus.process_memory_mib([server_pid]).get(server_pid, 0.0) if gpus.available else 0.0
            control.load(model)
            time.sleep(3)
            pids = server.stub_processes().get(model, [])
            row: dict[str, Any] = {"model": model, "processes": len(pids)}
            if gpus.available:
                per = gpus.process_memory_mib([*pids, server_pid])
                row.update(device_delta_mib=gpus.memory_used_mib()[0] - before,
                           stub_mib=sum(per.get(p, 0.0) for p in pids),
                           server_delta_mib=per.get(server_pid, 0.0) - server_before)
            control.unload(model)
            _settle(gpus, server, model)
            rows.append(row)
            print(f"[stub-memory] {json.dumps(row)}", flush=True)
    traces = read_traces(trace)
    for row in rows:
        row["steps"] = {r["step"]: {k: r[k] for k in ("process_mib", "device_used_mib", "cuda_module_loading") if k in r}
                        for r in traces.get(row["model"], []) if r.get("kind") == "memory"}
    return rows


def write_report(res: dict[str, Any], path: Path) -> None:
    L = [f"# GPU memory of one block process inside Triton — {res['device']}", "",
         f"Plan `{res['plan']}`; each model loaded alone into an otherwise empty server (CUDA pool "
         f"{res['cuda_pool_mb']} MiB), then unloaded. *device Δ*: the GPU's used memory after the load minus before; "
         "*stub*: NVML's figure for the stub process; *server Δ*: the server process's growth; then the stub's own "
         "NVML figure after each step of `initialize` (MiB).", "",
         "| variant | model | device Δ | stub | server Δ | at start | + context | + weights | + warm-up | + TensorMQ | + monitor |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant, rows in res["variants"].items():
        for r in rows:
            s = r.get("steps", {})
            cells = [f"{s[k]['process_mib']:.0f}" if "process_mib" in s.get(k, {}) else "—"
                     for k in ("start", "context", "weights", "warmup", "tensormq", "monitor")]
            L.append(f"| {variant} | {r['model']} | {r.get('device_delta_mib', 0):.0f} | {r.get('stub_mib', 0):.0f} | "
                     f"{r.get('server_delta_mib', 0):.0f} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="*", default=["b0", "b0__triton_gpu", "r50__ref", "r50__ref_graph"])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--cuda-pool-mb", type=int, default=CUDA_POOL_MB)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    repo = Path(tempfile.mkdtemp(prefix="bench-stubmem-repo-"))
    generator.write(generator.render(load_plan(args.plan)), repo)
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "?"
    res: dict[str, Any] = {"device": device, "plan": str(args.plan), "cuda_pool_mb": args.cuda_pool_mb, "variants": {}}
    for v in args.variants:
        res["variants"][v] = measure(repo, args.models, VARIANTS[v], args.cuda_pool_mb)
    (args.out / "stub_memory.json").write_text(json.dumps(res, indent=2))
    write_report(res, args.out / "stub_memory.md")
    print((args.out / "stub_memory.md").read_text())


if __name__ == "__main__":
    main()
