"""`blockflow bench`: every transport of a task and its monolithic references, side by side, in one server.

What it measures (each maps to a figure of the thesis, ch. 4; see bench/report.py):

* gpu alone — first, in a process of its own: the task's whole network as a block builds it, CUDA graph
              replays at batch 1, 32 and 128, what every served row is compared with (bench/gpu_alone.py);
* pipeline  — batch 1, concurrency 1: p50/p99 and, per ensemble, each block's compute time
              and the rest (overhead) from Triton's statistics (Fig. 4.3, 4.4);
* batch     — batch 1, 8, 32 at concurrency 1 (Fig. 4.7);
* concurrency — batch 1 at rising concurrency: latency and throughput, GPU utilisation,
              power and energy per inference from NVML (Fig. 4.10, 4.11);
* rate      — open-loop Poisson arrivals at fractions of the monolithic model's peak (Fig. 4.12);
* clients   — `blockflow load` closed-loop clients on the task (Fig. 4.11, the thesis' generator);
* gpus      — the task's blocks spread over 1, 2, 4 GPUs, one server per layout (Fig. 4.15-4.16).

Everything lands in ``results.json``; ``report.md`` and the PNG plots are drawn from it.
"""

from __future__ import annotations

import asyncio
import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blockflow.bench import gpu_alone, host_cpu
from blockflow.bench.harness import commit, rendered, switches
from blockflow.bench.nvml import GpuSampler
from blockflow.bench.perf_analyzer import FAILURE_LINES, INPUTS, encoded_input_data, median_of, perf_analyzer, side_input_data
from blockflow.bench.plans import answer_bytes, in_precision, spread, task_models
from blockflow.bench.report import write_report
from blockflow.bench.triton_stats import block_breakdown, compute_ms, delta, model_stats, tmq_counters
from blockflow.clients.load import LoadSpec, run_load, summarize
from blockflow.core.errors import BlockFlowError
from blockflow.core.nvml import gpu_count
from blockflow.plan import Plan, load_plan
from blockflow.triton.server import ServerOptions, TritonServer

SECTIONS = ("batch", "concurrency", "rate", "clients", "gpus")


@dataclass
class BenchConfig:
    plan: Path
    out: Path
    quick: bool = False
    seconds: float = 2.0  # perf_analyzer measurement window
    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    rate_fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])
    clients: list[int] = field(default_factory=lambda: [1, 4, 16])
    client_seconds: float = 5.0
    gpu_layouts: list[int] = field(default_factory=lambda: [2, 4])  # 1 GPU is the main run itself
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))
    mps: bool = False  # serve under a private MPS daemon (blockflow.triton.mps)
    warm_cores_ms: float = 0.0  # keep the CPUs out of idle after each block call (blockflow.triton.warm_cores)
    repeats: int = 3  # perf_analyzer runs per figure: the median is reported, with the runs' spread
    input: str = "host"  # how perf_analyzer sends inputs: "host" (in the request) or "cuda-shm"
    precision: str | None = None  # every block in this precision instead of the plan's
    gpu_alone: bool = True  # measure the task's whole network in a plain process first (blockflow.bench.gpu_alone)
    client_threads: int = 0  # perf_analyzer's closed loop on this many threads, asynchronously; 0: a thread per request

    @classmethod
    def quick_config(cls, plan: Path, out: Path) -> BenchConfig:
        """A few minutes on a CPU machine: every section, fewer and shorter points."""
        return cls(plan, out, quick=True, seconds=1.0, batches=[1, 4], concurrencies=[1, 4], rate_fractions=[0.5, 1.0],
                   clients=[1, 4], client_seconds=2.0, gpu_layouts=[2], repeats=1)


class Bench:
    """Runs the sections against one server; ``log`` receives one line per measurement and
    ``checkpoint`` the results so far after each model of a section (``meta.complete`` is false
    until the end)."""
    def __init__(self, cfg: BenchConfig, log: Callable[[str], None] = print,
                 checkpoint: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.checkpoint = checkpoint or (lambda _res: None)
        self.gpus = GpuSampler()
        self.plan = load_plan(cfg.plan)
        if cfg.precision is not None:
            self.plan = in_precision(self.plan, cfg.precision)
        if cfg.input not in INPUTS:
            raise BlockFlowError(f"unknown input path {cfg.input!r}; choose from {', '.join(INPUTS)}")
        self.task = next(iter(self.plan.tasks.values()))
        c, h, w = self.plan.block_in_shape(self.plan.blocks[self.task.path[0]])
        self.shape: str | None = f"IMAGE:{c},{h},{w}"
        self.image_shape = (c, h, w)
        # A task that takes encoded images is sent real JPEGs (one file's bytes per row, padded to the
        # longest), not random bytes; the data file gives their shape.
        self.input_data: Path | None = None
        first = self.plan.models[self.plan.blocks[self.task.path[0]].model]
        if first.input is not None and first.input.dtype == "encoded":
            self.shape = None
            self.input_data = encoded_input_data(Path(tempfile.mkdtemp(prefix="bench-images-")) / "images.json",
                                                 sides=self.plan.task_side_inputs(self.task))
        elif sides := self.plan.task_side_inputs(self.task):  # random bytes would be no valid side input (a size)
            self.input_data = side_input_data(Path(tempfile.mkdtemp(prefix="bench-inputs-")), first.image_shape,
                                              first.image is not None and first.image.dtype == "uint8", sides)
        self.output_bytes = answer_bytes(self.plan, self.task.name, max(cfg.batches))

    # ------------------------------------------------------------------ models of a plan

    def models(self, plan: Plan) -> dict[str, dict[str, Any]]:
        return task_models(plan, self.task.name)

    def measure(self, server: TritonServer, model: dict[str, Any], batch: int, concurrency: int | None = None,
                rate: float | None = None) -> dict[str, Any]:
        before, counted = model_stats(server.http_url), tmq_counters(server.metrics_url)
        log_at = server.log_size()
        cpu0, e0, t0, wall0 = host_cpu.snapshot(server), self.gpus.energy_mj(), time.monotonic(), time.time()
        r = median_of([self._pa(server, model["model"], batch, self.cfg.seconds, concurrency, rate)
                       for _ in range(max(1, self.cfg.repeats))])
        t1, e1, cpu1 = time.monotonic(), self.gpus.energy_mj(), host_cpu.snapshot(server)
        d = delta(model_stats(server.http_url), before)
        top = d.get(model["model"], {})
        inferences = top.get("inferences", 0)
        if self.gpus.available and inferences:
            r["energy_mj_per_inference"] = sum(b - a for a, b in zip(e0, e1, strict=True)) / inferences
            r.update(self.gpus.window(t0, t1))
            if cpu1 is not None and server.process is not None and (sm := self.gpus.process_sm_pct(
                    wall0, {"tritonserver": [server.process.pid], **{m: list(p) for m, p in cpu1.blocks.items()}})):
                r["gpu_sm_pct"] = sm
        if cpu0 is not None and cpu1 is not None and inferences:
            own = frozenset([model["model"], *model["blocks"]])  # the measured model and its blocks; the rest idle meanwhile
            r["host_cpu_ms_per_inference"] = host_cpu.per_inference(cpu0, cpu1, inferences, own)
        if "error" in r:  # the server's side of it (a block's exception is logged there, not sent whole)
            r["server_errors"] = server.log_since(log_at, FAILURE_LINES)
        r["server_compute_ms"] = compute_ms(top)
        blocks = block_breakdown(d, model["blocks"], batch, delta(tmq_counters(server.metrics_url), counted))
        if blocks:
            r["blocks"] = blocks
            r["block_compute_ms"] = sum(b["compute_ms"] for b in blocks)
        return r

    def _pa(self, server: TritonServer, model: str, batch: int, seconds: float, concurrency: int | None = None,
            rate: float | None = None) -> dict[str, Any]:
        return perf_analyzer(server.http_url, model, self.shape, batch, seconds, concurrency, rate,
                             self.cfg.input, self.output_bytes, server.shm_key_file, self.input_data, self.cfg.client_threads)

    def _line(self, section: str, label: str, point: str, r: dict[str, Any]) -> None:
        keys = ("p50_ms", "p99_ms", "throughput", "energy_mj_per_inference")
        spread = r.get("spread", {})
        self.log(f"[bench] {section:11s} {label:18s} {point:8s} "
                 + "  ".join(f"{k}={r[k]:.3f}" + (f"(±{spread[k] * 50:.0f}%)" if k in spread else "") for k in keys if k in r)
                 + ("  FAILED" if "error" in r else ""))

    # ------------------------------------------------------------------ sections

    def _serve(self, plan: Plan) -> TritonServer:
        repo = rendered(plan, "blockflow-bench-")
        server = TritonServer(ServerOptions.on_free_ports([repo], mps=self.cfg.mps, warm_cores_ms=self.cfg.warm_cores_ms))
        server.start(900)
        return server

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        res: dict[str, Any] = {"meta": self._meta(), "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                               "task": self.task.name, "path": list(self.task.path)}
        self._gpu_alone(res["meta"])  # before the server starts: its process and CUDA context are gone by then
        self.gpus.start()
        server = self._serve(self.plan)
        try:
            models = self.models(self.plan)
            res["models"] = {k: v["model"] for k, v in models.items()}
            res["memory"] = self._memory(server)
            self.checkpoint(res)
            for m in models.values():  # warm-up, not recorded
                self._pa(server, m["model"], 1, 0.5, 1)
            res["pipeline"] = {}
            res["batch"] = {}
            for label, m in models.items():  # batch 1 is the pipeline figure; the batch sweep adds the rest
                for b in cfg.batches if "batch" in cfg.sections else cfg.batches[:1]:
                    r = self.measure(server, m, b, concurrency=1)
                    res["batch"].setdefault(label, {})[str(b)] = r
                    self._line("batch", label, f"b{b}", r)
                res["pipeline"][label] = res["batch"][label][str(cfg.batches[0])]
                self.checkpoint(res)
            res["concurrency"] = {}
            if "concurrency" in cfg.sections or "gpus" in cfg.sections:
                for label, m in models.items():
                    for c in cfg.concurrencies:
                        if c == 1 and "1" in res["batch"].get(label, {}):  # batch 1 at concurrency 1: the same point, not run twice
                            r = dict(res["batch"][label]["1"], from_batch_section=True)
                        else:
                            r = self.measure(server, m, 1, concurrency=c)
                        res["concurrency"].setdefault(label, {})[str(c)] = r
                        self._line("concurrency", label, f"c{c}", r)
                    self.checkpoint(res)
            if "rate" in cfg.sections:
                peak = self._peak(res["concurrency"])
                res["rate"] = {"peak_per_s": peak}
                for label, m in models.items():
                    for frac in cfg.rate_fractions:
                        r = self.measure(server, m, 1, rate=max(1.0, peak * frac))
                        r["offered_per_s"] = max(1.0, peak * frac)
                        res["rate"].setdefault(label, {})[f"{frac:g}"] = r
                        self._line("rate", label, f"{frac:g}x", r)
                    self.checkpoint(res)
            if "clients" in cfg.sections:
                res["clients"] = self._clients(server, models)
                self.checkpoint(res)
        finally:
            server.stop()
        if "gpus" in cfg.sections:
            res["gpus"] = self._gpu_layouts(res["concurrency"], lambda layouts: self.checkpoint({**res, "gpus": layouts}))
        self.gpus.stop()
        res["meta"]["complete"] = True
        return res

    def _meta(self) -> dict[str, Any]:
        import torch

        return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "plan": str(self.cfg.plan),
                "plan_name": self.plan.raw.name, "gpus": self.gpus.names(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "quick": self.cfg.quick,
                "commit": commit(),
                # Like with like: the split and its monolithic references in one precision, one input path.
                "precision": self.plan.precision_label(self.task),
                "reference_precision": self.plan.precision_label(self.task),
                "mps": self.cfg.mps, "warm_cores_ms": self.cfg.warm_cores_ms, "input": self.cfg.input, "repeats": self.cfg.repeats,
                "client_threads": self.cfg.client_threads, "switches": switches(),
                "cuda_graphs": sorted({self.plan.blocks[b].cuda_graphs for b in self.task.path}),
                "complete": False}

    def _gpu_alone(self, meta: dict[str, Any]) -> None:
        """``meta.gpu_alone``: the task's whole network in a plain process, what each served row is
        compared with; None, and ``gpu_alone_reason`` why, where it was not measured."""
        figures: dict[str, Any] | None = None
        reason: str | None = "not asked for (--no-gpu-alone)"
        if self.cfg.gpu_alone:
            figures, reason = gpu_alone.measure_in_child(self.cfg.plan, self.task.name, self.plan.task_precision(self.task))
        meta["gpu_alone"] = figures
        if figures is None:
            meta["gpu_alone_reason"] = reason
            self.log(f"[bench] gpu alone   not measured: {reason}")
        else:
            self.log(f"[bench] gpu alone   {gpu_alone.describe(figures)}")

    def _peak(self, conc: dict[str, dict[str, dict[str, Any]]]) -> float:
        """The offered-load scale: the best throughput any model reached in the concurrency sweep."""
        best = [r.get("throughput", 0.0) for rows in conc.values() for r in rows.values()]
        return float(max(best + [1.0]))

    def _memory(self, server: TritonServer) -> dict[str, Any]:
        stubs = server.stub_processes()
        per_pid = self.gpus.process_memory_mib(p for pids in stubs.values() for p in pids) if self.gpus.available else {}
        import psutil

        out: dict[str, Any] = {"gpu_used_mib": self.gpus.memory_used_mib() if self.gpus.available else [], "models": {}}
        for model, pids in sorted(stubs.items()):
            rss = 0.0
            for p in pids:
                try:
                    rss += psutil.Process(p).memory_info().rss / 2**20
                except psutil.Error:
                    pass
            gpu = [per_pid[p] for p in pids if p in per_pid]
            out["models"][model] = {"processes": len(pids), "rss_mib": rss, "gpu_mib": sum(gpu) if gpu else None}
        return out

    def _clients(self, server: TritonServer, models: dict[str, dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for label, m in models.items():
            for n in self.cfg.clients:
                spec = LoadSpec(url=server.http_url, tasks=[m["model"]], shape=self.image_shape, clients=n,
                                duration_s=self.cfg.client_seconds)
                records = asyncio.run(run_load(spec))
                s = summarize(records, self.cfg.client_seconds).get(m["model"], {})
                row = {"requests": s.get("requests", 0.0), "errors": s.get("errors", 0.0), "throughput": s.get("throughput", 0.0),
                       "p50_ms": s.get("p50", float("nan")), "p99_ms": s.get("p99", float("nan"))}
                out.setdefault(label, {})[str(n)] = row
                self._line("clients", label, f"n{n}", row)
        return out

    def _gpu_layouts(self, one_gpu: dict[str, dict[str, Any]],
                     progress: Callable[[dict[str, Any]], None] = lambda _layouts: None) -> dict[str, Any]:
        """The task's blocks round-robin over k GPUs (k = 2, 4 as available), one server per layout.

        k = 1 is the main run (every block on GPU 0); its tensormq and triton-gpu rows are reused.
        ``progress`` gets the layouts measured so far after each one.
        """
        have = gpu_count()
        out: dict[str, Any] = {}
        if have >= 1 and one_gpu:
            top = str(max(self.cfg.concurrencies))
            out["1"] = {label: {c: one_gpu[label][c] for c in ("1", top) if c in one_gpu.get(label, {})}
                        for label in ("tensormq", "triton-gpu") if label in one_gpu}
        layouts = [k for k in self.cfg.gpu_layouts if 2 <= k <= have]
        if not layouts:
            out["skipped"] = f"{have} GPU(s) visible: no layout over several GPUs"
            return out
        for k in layouts:
            plan = spread(self.plan, self.task.name, k)
            server = self._serve(plan)
            try:
                models = {label: m for label, m in self.models(plan).items() if label in ("tensormq", "triton-gpu")}
                for label, m in models.items():
                    self._pa(server, m["model"], 1, 0.5, 1)
                    for c in (1, max(self.cfg.concurrencies)):
                        r = self.measure(server, m, 1, concurrency=c)
                        out.setdefault(str(k), {}).setdefault(label, {})[str(c)] = r
                        self._line(f"gpus={k}", label, f"c{c}", r)
            finally:
                server.stop()
            progress(out)
        return out


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> Path:
    """Run everything, write results.json, report.md and the plots; returns the output directory."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    saved: list[bool] = []  # whether this run has written results.json yet (the folder may hold an older one)

    def save(res: dict[str, Any]) -> None:
        # After every model of every section, so a run cut short (a time limit, a crash) keeps what
        # it measured: `python -m blockflow.bench.report DIR` draws a report from it. Replaced atomically.
        tmp = cfg.out / "results.json.tmp"
        tmp.write_text(json.dumps(res, indent=2))
        tmp.replace(cfg.out / "results.json")
        saved.append(True)

    try:
        results = Bench(cfg, log, checkpoint=save).run()
    except OSError as exc:
        kept = f"; what it measured before is in {cfg.out / 'results.json'}" if saved else ""
        raise BlockFlowError(f"benchmark failed: {exc}{kept}") from exc
    save(results)
    write_report(results, cfg.out)
    return cfg.out
