"""The GPU alone: a task's whole network in a plain process, no server, as fast as the GPU runs it.

What every served figure of ``blockflow bench`` is compared with (``results.json`` ``meta.gpu_alone``):
the task's monolithic reference built as a block builds it (:class:`BlockRunner`: the plan's weights,
batch norm folded, the precision and its TF32 switches, channels-last, eval, inference mode), one CUDA
graph per batch size, its replays timed with CUDA events (the median). Batch 1 gives a latency,
batches 32 and 128 images per second. For a task that takes JPEG/PNG files (``dtype: encoded``) it also
times the block's decode of a batch of the sample JPEGs (:class:`ImageDecoder`: nvJPEG, resize), and
``images_per_s_decoded`` is each batch's images over decode plus network, what served JPEG rows are
compared with.

    python -m blockflow.bench.gpu_alone --plan plans/bench_r50.yaml --precision fp16 --json

It runs in a child process of the bench (:func:`measure_in_child`), before the server starts, so
its CUDA context and memory are gone by then. ``--json`` prints one line,
``{"gpu_alone": FIGURES or null, "reason": WHY NULL}``. ``--device cpu`` runs the same steps eagerly
on the CPU (timed by the host clock), to try the module where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockflow.backend.runtime import BlockRunner

SIZES = (1, 32, 128)
REPLAYS = {1: 100}  # timed replays per batch size; OTHER_REPLAYS for the others
OTHER_REPLAYS = 30
WARM_S = 0.5  # replays before the timed ones, long enough for the GPU's clocks to rise
CHILD_TIMEOUT_S = 900.0
GRAPHS_OFF = "CUDA graphs are switched off in this environment (BLOCKFLOW_DISABLE_CUDA_GRAPHS=1)"  # nothing to time


def _median_ms(step: Callable[[], object], replays: int, cuda: bool) -> float:
    """The median time of ``step`` over ``replays`` calls after ``WARM_S`` of warm-up: by CUDA events
    around each call (GPU time) on a GPU, by the host clock on the CPU."""
    import torch

    end_warm = time.monotonic() + WARM_S
    warmed = 0
    while warmed < 3 or time.monotonic() < end_warm:
        step()
        warmed += 1
        if cuda:
            torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            step()
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(samples))


def measure(plan_path: Path, task_name: str | None = None, precision: str | None = None,
            sizes: tuple[int, ...] = SIZES, device: str = "cuda") -> tuple[dict[str, Any] | None, str | None]:
    """The figures of the task (the plan's first by default) in ``precision`` (the task's by default),
    or None and why. A batch size whose graph does not fit the GPU's memory is left out (``skipped``
    says so), and so is every larger one."""
    import torch

    from blockflow.backend.runtime import BlockRunner
    from blockflow.ensemble_gen.generator import reference_spec
    from blockflow.plan import load_plan

    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        return None, "no GPU visible to torch"
    plan = load_plan(plan_path)
    task = plan.tasks[task_name] if task_name is not None else next(iter(plan.tasks.values()))
    spec, _ = reference_spec(plan, task, graph=True)
    spec = spec.model_copy(update={"precision": precision or spec.precision, "max_batch_size": max(sizes)})
    runner = BlockRunner(spec, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    if cuda and not runner.use_graphs:
        return None, GRAPHS_OFF
    batch_ms, skipped = batch_times(runner, sizes, cuda)
    if not batch_ms:
        return None, f"no batch size fitted: {skipped}"
    out: dict[str, Any] = {
        "batch1_ms": batch_ms.get("1"),
        "images_per_s": {b: int(b) / ms * 1e3 for b, ms in batch_ms.items() if b != "1"},
        "batch_ms": batch_ms,
        "precision": spec.precision,
        "memory_format": "channels_last" if cuda and runner.formats[0] == torch.channels_last else "contiguous",
        "cuda_graph": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "task": task.name,
        "replays": {str(b): REPLAYS.get(b, OTHER_REPLAYS) for b in sorted(sizes)},
    }
    if skipped:
        out["skipped"] = skipped
    from blockflow.backend.image_input import takes_encoded

    if takes_encoded(spec):
        decode_ms = {b: _time_decode(spec.input_shape, runner.device, int(b), cuda) for b in batch_ms if b != "1"}
        out["decode_ms"] = decode_ms
        out["images_per_s_decoded"] = {b: int(b) / (ms + batch_ms[b]) * 1e3 for b, ms in decode_ms.items()}
    return out, None


def batch_times(runner: BlockRunner, sizes: tuple[int, ...], cuda: bool) -> tuple[dict[str, float], dict[str, str]]:
    """The median ms of one batch of each size (:func:`_time_batch`), and the sizes left out and why: a
    size whose graph does not fit the GPU's memory, and every larger one."""
    import torch

    batch_ms: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for b in sorted(sizes):
        if skipped:
            skipped[str(b)] = "a smaller batch did not fit"
            continue
        try:
            batch_ms[str(b)] = _time_batch(runner, b, REPLAYS.get(b, OTHER_REPLAYS), cuda)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # an allocation during capture fails the capture too
            if not isinstance(exc, torch.cuda.OutOfMemoryError) and "out of memory" not in str(exc):
                raise
            skipped[str(b)] = f"out of GPU memory ({str(exc).splitlines()[0]})"
        finally:
            runner._graphs.clear()  # one batch size's graph at a time: each size gets the whole GPU's memory
            if cuda:
                torch.cuda.empty_cache()
    return batch_ms, skipped


def _time_decode(chw: list[int] | tuple[int, ...], device: Any, batch: int, cuda: bool) -> float:
    """The median ms of decoding ``batch`` of the sample JPEGs (cycled) to the network's size on ``device``,
    one file per request as a served call takes them, the host waiting for the device's part."""
    import torch

    from blockflow.backend.image_decode import ImageDecoder
    from blockflow.bench.perf_analyzer import SAMPLE_IMAGES
    from blockflow.clients.images import random_jpegs

    files = [f.read_bytes() for f in sorted(SAMPLE_IMAGES.glob("*.jpg"))] or [bytes(b) for b in random_jpegs(4)[:, 0]]
    requests = [[files[k % len(files)]] for k in range(batch)]
    decoder = ImageDecoder(chw, device)

    def step() -> None:
        decoder.decode(requests)
        if cuda:
            torch.cuda.synchronize(device)

    return _median_ms(step, OTHER_REPLAYS, cuda=False)


def _time_batch(runner: BlockRunner, batch: int, replays: int, cuda: bool) -> float:
    """The median ms of one batch of ``batch`` images: a replay of the runner's CUDA graph of that
    batch (captured as its warm-up captures it: the fp32 image converted to the block's precision and
    layout, the network, the logits in fp32; a detector's eager node after it), or an eager run on the CPU."""
    import torch

    if not cuda:
        x = torch.zeros(batch, *runner.in_shapes[0], dtype=runner.in_dtype)  # a uint8 task's image is uint8
        # Task inputs besides the image (an exported program's): ones, as `blockflow load` sends.
        sides = [torch.ones(batch, *s.shape, dtype=d) for s, d in zip(runner.sides, runner.side_dtypes, strict=True)]

        def eager() -> None:
            runner.run_all([x, *sides])

        return _median_ms(eager, replays, cuda=False)
    runner.buckets = [batch]  # warmup() captures one graph per bucket: this batch's only
    runner.warmup()
    if runner.tail is None:
        return _median_ms(runner._graphs[batch].graph.replay, replays, cuda=True)
    # A detector: its traced stages' graph, then its eager node, as the block runs them.
    return _median_ms(lambda: runner.replay_bucket(batch), replays, cuda=True)


def parse_child(returncode: int, stdout: str, stderr: str) -> tuple[dict[str, Any] | None, str | None]:
    """What the child (``--json``) printed: its figures, or None and why (its own reason, or its failure)."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
    if returncode == 0 and line is not None:
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "gpu_alone" in answer:
            figures = answer["gpu_alone"]
            return (figures, None) if figures is not None else (None, str(answer.get("reason") or "not measured"))
    last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "no output")
    return None, f"the measuring process failed (exit {returncode}): {last.strip()}"


def measure_in_child(plan_path: Path, task: str, precision: str,
                     timeout_s: float = CHILD_TIMEOUT_S) -> tuple[dict[str, Any] | None, str | None]:
    """:func:`measure` in a fresh process (its CUDA context and memory gone when it returns); None and
    why where NVML sees no GPU, without starting one."""
    from blockflow.core.nvml import gpu_count
    from blockflow.triton.process_group import run_child

    if gpu_count() == 0:
        return None, "no GPU visible (NVML sees none)"
    cmd = [sys.executable, "-m", "blockflow.bench.gpu_alone", "--plan", str(plan_path), "--task", task,
           "--precision", precision, "--json"]
    try:
        run = run_child(cmd, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"the measuring process did not finish within {timeout_s:g} s"
    return parse_child(run.returncode, run.stdout, run.stderr)


def describe(figures: dict[str, Any]) -> str:
    """One line of the figures, for a log or a report."""
    ips = figures.get("images_per_s", {})
    parts = [f"batch 1: {figures['batch1_ms']:.3f} ms"] if figures.get("batch1_ms") is not None else []
    parts += [f"batch {b}: {v:,.0f} images/s" for b, v in sorted(ips.items(), key=lambda kv: int(kv[0]))]
    parts += [f"batch {b} with its JPEGs decoded: {v:,.0f} images/s"
              for b, v in sorted(figures.get("images_per_s_decoded", {}).items(), key=lambda kv: int(kv[0]))]
    parts += [f"batch {b}: skipped ({why})" for b, why in figures.get("skipped", {}).items()]
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--task", default=None, help="the task whose network is measured (default: the plan's first)")
    ap.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default=None, help="default: the task's")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="batch sizes, comma-separated")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: eager, host clock (to try the module)")
    ap.add_argument("--json", action="store_true", help='print one line: {"gpu_alone": FIGURES or null, "reason": ...}')
    args = ap.parse_args(argv)
    sizes = tuple(sorted({int(s) for s in args.sizes.split(",")}))
    figures, reason = measure(args.plan, args.task, args.precision, sizes, args.device)
    if args.json:
        print(json.dumps({"gpu_alone": figures, "reason": reason}))
    elif figures is None:
        print(f"not measured: {reason}")
    else:
        print(f"{figures['task']} whole, {figures['precision']}, {figures['memory_format']}, on {figures['device']}: {describe(figures)}")


if __name__ == "__main__":
    main()
