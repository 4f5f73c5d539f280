"""What one ensemble step costs with no block work at all: the floor under a TensorMQ hop.

A Python-backend model that only copies its 256-byte input (a ticket's size) to its output is
served alone and as ensembles of 1 and 4 such steps, each step its own model (its own stub
process, as blocks are), on one real ``tritonserver``; perf_analyzer measures each at
concurrency 1, batch 1. The cost of one step is ``(p50(4 steps) - p50(1 step)) / 3``.

Two things that could make up that floor are switched in turns, in one server:

- ``batching``: the models with Triton's dynamic batcher (as blocks have, delay 0) or without;
- ``cpu_latency``: this process holding ``/dev/cpu_dma_latency`` at 0 (the kernel's PM QoS
  request that keeps every core out of deep C-states while the file is open; needs root), or not.
  A step is a chain of thread and process wake-ups (ensemble callback, scheduler, model
  instance, stub, back); a core woken from a deep C-state takes tens of microseconds.

Each combination is measured ``--repeats`` times, alternating, and reported as the median and
its spread. Triton's per-model statistics of the 4-step chain say where a step's time goes.

    python -m blockflow.bench.ensemble_floor --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.bench.harness import device_name
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.triton.server import ServerOptions, TritonServer

TICKET = 256
STEPS = (1, 4)
COPY_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        # A copy: an output that is the input's own buffer comes out empty on a KIND_GPU instance
        # (python_backend r24.10, seen on an H100), and a block's output is a new buffer too.
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().copy())])
                for r in requests]
'''


def _copy_config(name: str, batching: bool) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=32)
    cfg.input.add(name="IN", data_type=mc.TYPE_UINT8, dims=[TICKET])
    cfg.output.add(name="OUT", data_type=mc.TYPE_UINT8, dims=[TICKET])
    cfg.instance_group.add(count=1)
    if batching:
        cfg.dynamic_batching.max_queue_delay_microseconds = 0
    cfg.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "yes"
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


def write_repository(repo: Path) -> list[str]:
    """The copy models (4 per batching setting) and their chains; returns what perf_analyzer measures."""
    measured = []
    for batching in (True, False):
        b = _name(batching)
        copies = [f"copy_{b}_{i}" for i in range(max(STEPS))]
        configs = [_copy_config(n, batching) for n in copies]
        configs += [_chain_config(f"chain{k}_{b}", copies[:k]) for k in STEPS]
        for cfg in configs:
            d = repo / cfg.name
            (d / "1").mkdir(parents=True)
            (d / "config.pbtxt").write_text(text_format.MessageToString(cfg))
            if cfg.backend == "python":
                (d / "1" / "model.py").write_text(COPY_MODEL)
        measured += [copies[0]] + [f"chain{k}_{b}" for k in STEPS]
    return measured


@contextlib.contextmanager
def cpu_latency(hold: bool) -> Iterator[bool]:
    """While open, ``/dev/cpu_dma_latency`` set to 0 keeps cores out of deep C-states; yields whether it is held."""
    if not hold:
        yield False
        return
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


def _stats(server: TritonServer, models: list[str]) -> dict[str, dict[str, float]]:
    """Per-request queue and compute times (µs) of ``models`` since the server started."""
    out = {}
    for name, m in server.api().statistics().items():
        if name not in models:
            continue
        s = m.get("inference_stats", {})
        n = max(int(s.get("success", {}).get("count", 0)), 1)
        out[name] = {k: int(s.get(k, {}).get("ns", 0)) / n / 1e3 for k in ("queue", "compute_input", "compute_infer", "compute_output")}
    return out


def run(out: Path, seconds: float, repeats: int) -> dict[str, Any]:
    repo = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    measured = write_repository(repo)
    runs: dict[str, list[float]] = {}
    held_ok = False
    with TritonServer(ServerOptions.on_free_ports([repo])) as server:
        for model in measured:  # warm-up, not recorded: the first requests of a model are slower
            perf_analyzer(server.http_url, model, f"IN:{TICKET}", 1, seconds / 2, concurrency=1)
        for _, hold in itertools.product(range(repeats), (False, True)):
            with cpu_latency(hold) as held:
                held_ok |= held
                for model in measured:
                    r = perf_analyzer(server.http_url, model, f"IN:{TICKET}", 1, seconds, concurrency=1)
                    if "error" in r:
                        raise RuntimeError(f"perf_analyzer on {model}: {r.get('message', r)}")
                    runs.setdefault(f"{model}|{'held' if held else 'free'}", []).append(r["p50_ms"])
        stats = _stats(server, [f"copy_{_name(b)}_{i}" for b in (True, False) for i in range(max(STEPS))])
    rows = []
    for batching, state in itertools.product((True, False), ("free", "held")):
        b = _name(batching)
        models = (("alone", f"copy_{b}_0"), *((f"chain{k}", f"chain{k}_{b}") for k in STEPS))
        p = {k: statistics.median(runs.get(f"{m}|{state}", [float("nan")])) for k, m in models}
        spread = {m: (max(v) - min(v)) / statistics.median(v) for _, m in models if (v := runs.get(f"{m}|{state}"))}
        rows.append({"batching": batching, "cpu_latency": state, **{f"{k}_p50_ms": v for k, v in p.items()},
                     "step_ms": (p["chain4"] - p["chain1"]) / 3, "max_spread": max(spread.values(), default=0.0)})
    result = {"meta": {"device": device_name(), "seconds": seconds, "repeats": repeats, "cpu_latency_held": held_ok},
              "rows": rows, "runs": runs, "stats_us": stats}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "report.md").write_text(report(result))
    return result


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [f"# Ensemble-step floor on {meta['device']}", "",
             f"perf_analyzer over HTTP, batch 1, concurrency 1, {meta['seconds']} s windows, median of {meta['repeats']} "
             "runs (spread: the largest (max - min) / median of a row's figures). A step copies 256 bytes in a Python-backend model.",
             "", "| dynamic batcher | cpu_dma_latency 0 | model alone p50 | 1-step ensemble p50 | 4-step ensemble p50 | one step | spread |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        held = "held" if r["cpu_latency"] == "held" and meta["cpu_latency_held"] else ("not held" if r["cpu_latency"] == "free" else "not available")
        lines.append(f"| {'on' if r['batching'] else 'off'} | {held} | {r['alone_p50_ms']:.3f} ms | {r['chain1_p50_ms']:.3f} ms | "
                     f"{r['chain4_p50_ms']:.3f} ms | {r['step_ms']:.3f} ms | {r['max_spread']:.0%} |")
    lines += ["", "Triton's statistics per request of each copy model over the whole run (µs):", "",
              "| model | queue | compute input | compute infer | compute output |", "|---|---|---|---|---|"]
    for name, s in sorted(res["stats_us"].items()):
        lines.append(f"| {name} | {s['queue']:.0f} | {s['compute_input']:.0f} | {s['compute_infer']:.0f} | {s['compute_output']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(report(run(args.out, args.seconds, args.repeats)))


if __name__ == "__main__":
    main()
