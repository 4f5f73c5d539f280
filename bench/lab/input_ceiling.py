"""What the server's input path alone allows for a host-memory image: the ceiling under a first block.

A first block and the unsplit model take the same path for a host image: perf_analyzer sends
it over HTTP, Triton reads the body, the Python backend copies it into the stub's shared memory
and wakes the stub. A *sink* model here takes that path and does nothing else: a Python-backend
model configured as a first block is (``IMAGE`` fp32 3×224×224, ``max_batch_size`` 32, Triton's
dynamic batcher with no delay, ``FORCE_CPU_ONLY_INPUT_TENSORS: no``) that answers every request
with a 256-byte output, a ticket's size, without reading its input. Measured alone with one and
with two instances (is the ceiling a stub's or the server's?), behind a one-step ensemble (a
task's entry), and with glibc's malloc thresholds fixed in its stub (``mallopt``: the stub's copy
of each input then reuses mapped pages), at concurrency 1 and 32, in turns on one server.

If the sink's c32 throughput is close to the unsplit model's with host inputs, no split can serve
much more than the unsplit model at c32 with host inputs, whatever its blocks do. ``--plan`` serves
that plan's first task too, split and as its unsplit CUDA graph (``--precision``), in the same
server, measured in the same turns: sink and models side by side in one run.

    python -m blockflow.bench.lab.input_ceiling --out DIR [--plan plans/bench_r50.yaml --precision fp16]
        [--seconds 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.bench.harness import commit, device_name, rendered, write_results
from blockflow.bench.perf_analyzer import median_of, perf_analyzer
from blockflow.bench.plans import split_and_graph, task_models
from blockflow.bench.triton_stats import PHASES, delta, model_stats, phases_per_execution
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer

IMAGE = (3, 224, 224)
TICKET = 256
CONCURRENCY = (1, 32)
SINK_MODEL = """import ctypes
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if KEEP_HEAP:  # freed memory stays mapped: M_TRIM_THRESHOLD (-1) 256 MiB, M_MMAP_THRESHOLD (-3) 32 MiB
            mallopt = ctypes.CDLL(None).mallopt
            mallopt(-1, 256 << 20)
            mallopt(-3, 32 << 20)
        self.out = np.zeros((1, 256), dtype=np.uint8)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.out)]) for _ in requests]
"""


def sink_model(keep_heap: bool) -> str:
    """The sink's source; ``keep_heap``: with glibc's malloc thresholds fixed, so the stub's copy of
    each input (python_backend r24.10 copies every host input into a new NumPy array when it loads
    a request) reuses mapped pages instead of faulting them in again at every batch."""
    return SINK_MODEL.replace("KEEP_HEAP", repr(keep_heap))


def _sink_config(name: str, instances: int) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=32)
    cfg.input.add(name="IMAGE", data_type=mc.TYPE_FP32, dims=list(IMAGE))
    cfg.output.add(name="OUT", data_type=mc.TYPE_UINT8, dims=[TICKET])
    cfg.instance_group.add(count=instances)
    cfg.dynamic_batching.SetInParent()
    cfg.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "no"
    return cfg


def _entry_config(name: str, model: str) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=32)
    cfg.input.add(name="IMAGE", data_type=mc.TYPE_FP32, dims=list(IMAGE))
    cfg.output.add(name="OUT", data_type=mc.TYPE_UINT8, dims=[TICKET])
    step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
    step.input_map["IMAGE"] = "IMAGE"
    step.output_map["OUT"] = "OUT"
    return cfg


MEASURED = {
    "sink, 1 instance": "sink_i1",
    "sink, 2 instances": "sink_i2",
    "sink behind a 1-step ensemble": "entry_i1",
    "sink, 1 instance, malloc thresholds kept": "keep_i1",
}


def write_repository(repo: Path) -> None:
    configs = (_sink_config("sink_i1", 1), _sink_config("sink_i2", 2), _entry_config("entry_i1", "sink_i1"), _sink_config("keep_i1", 1))
    for cfg in configs:
        d = repo / cfg.name
        (d / "1").mkdir(parents=True)
        (d / "config.pbtxt").write_text(text_format.MessageToString(cfg))
        if cfg.backend == "python":
            (d / "1" / "model.py").write_text(sink_model(keep_heap=cfg.name.startswith("keep")))


def _per_execution(d: dict[str, int]) -> dict[str, float]:
    """Triton's phases in µs (queue per request, compute per execution) and requests per execution,
    under the keys of the committed results, from a statistics delta."""
    p = phases_per_execution(d)
    return {"queue": p["queue_ms_per_request"] * 1e3, **{k: p[f"{k}_ms"] * 1e3 for k in PHASES},
            "batch": p["samples_per_execution"]}


def plan_models(plan_path: Path, precision: str | None) -> tuple[Path, dict[str, str], dict[str, str]]:
    """The plan's first task, split and as its unsplit CUDA graph: its rendered repository, label ->
    model, and model -> the model whose statistics stand for it (the split's first block)."""
    plan = split_and_graph(load_plan(plan_path), precision)
    task = next(iter(plan.tasks.values()))
    if (shape := plan.block_in_shape(plan.blocks[task.path[0]])) != IMAGE:
        raise ValueError(f"{plan_path}: task {task.name!r} takes {list(shape)} images; the sinks take {list(IMAGE)}")
    models = task_models(plan, task.name)
    graph, split = models["monolithic-graph"]["model"], models["tensormq"]
    labels = {"the plan's unsplit CUDA graph": graph, f"the plan's {len(split['blocks'])}-block split": split["model"]}
    return rendered(plan, "bench-input-ceiling-plan-"), labels, {graph: graph, split["model"]: split["blocks"][0]}


def run(out: Path, seconds: float, repeats: int, plan: Path | None = None, precision: str | None = None) -> dict[str, Any]:
    repo = Path(tempfile.mkdtemp(prefix="bench-input-ceiling-"))
    write_repository(repo)
    repos, measured, first = [repo], dict(MEASURED), {m: m for m in MEASURED.values()} | {"entry_i1": "sink_i1"}
    if plan is not None:
        plan_repo, labels, firsts = plan_models(plan, precision)
        repos.append(plan_repo)
        measured |= labels
        first |= firsts
    shape = "IMAGE:" + ",".join(map(str, IMAGE))
    runs: dict[str, list[dict[str, Any]]] = {}
    stats: dict[str, dict[str, float]] = {}
    with TritonServer(ServerOptions.on_free_ports(repos)) as server:
        for model in measured.values():  # warm-up, not recorded
            perf_analyzer(server.http_url, model, shape, 1, seconds / 2, concurrency=8)
        for _, model, c in itertools.product(range(repeats), measured.values(), CONCURRENCY):
            before = model_stats(server.http_url)
            r = perf_analyzer(server.http_url, model, shape, 1, seconds, concurrency=c)
            if "error" in r:
                raise RuntimeError(f"perf_analyzer on {model} at c{c}: {r.get('message', r)}")
            runs.setdefault(f"{model}|c{c}", []).append(r)
            if c == max(CONCURRENCY):
                stats[model] = _per_execution(delta(model_stats(server.http_url), before)[first[model]])
    figures = {key: median_of(rs) for key, rs in runs.items()}
    result = {
        "meta": {
            "device": device_name(),
            "commit": commit(),
            "cpus": len(os.sched_getaffinity(0)),
            "seconds": seconds,
            "repeats": repeats,
            "input": "host",
            "image": list(IMAGE),
            "plan": None if plan is None else str(plan),
            "precision": precision,
        },
        "models": measured,
        "figures": figures,
        "stats_c32_last_run": stats,
    }
    return write_results(out, result, report)


def report(res: dict[str, Any]) -> str:
    meta, fig = res["meta"], res["figures"]
    c_hi = max(CONCURRENCY)
    lines = [
        f"# The input path's ceiling on {meta['device']} ({meta['cpus']} CPUs), commit {meta['commit']}",
        "",
        f"perf_analyzer over HTTP, host-memory fp32 images {'×'.join(map(str, meta['image']))}, batch 1, "
        f"{meta['seconds']} s windows, median of {meta['repeats']} runs taken in turns ± half their range. "
        "The sink answers without reading its input"
        + (f"; the plan's models ({meta['plan']}, {meta.get('precision') or 'its precision'}) are in the same server, "
           "their phases those of the first block." if meta.get("plan") else "."),
        "",
        f"| model | c1 p50 | c{c_hi} throughput | c{c_hi} p50 | requests per execution at c{c_hi} | "
        f"compute input, infer per execution at c{c_hi} |",
        "|---|---|---|---|---|---|",
    ]
    for label, model in res.get("models", MEASURED).items():
        if f"{model}|c1" not in fig:  # a run before this model was measured
            continue
        lo, hi, s = fig[f"{model}|c1"], fig[f"{model}|c{c_hi}"], res["stats_c32_last_run"].get(model, {})
        lines.append(
            f"| {label} | {lo['p50_ms']:.3f} ms ±{lo['spread']['p50_ms'] / 2:.0%} | "
            f"{hi['throughput']:.0f}/s ±{hi['spread']['throughput'] / 2:.0%} | {hi['p50_ms']:.2f} ms | "
            f"{s.get('batch', 0):.1f} | {s.get('compute_input', 0):.0f}, {s.get('compute_infer', 0):.0f} µs |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plan", type=Path, default=None, help="also serve this plan's first task, split and unsplit")
    ap.add_argument("--precision", default=None, help="the plan's blocks in this precision (default: the plan's)")
    args = ap.parse_args()
    print(report(run(args.out, args.seconds, args.repeats, args.plan, args.precision)))


if __name__ == "__main__":
    main()
