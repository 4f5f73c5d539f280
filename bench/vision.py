"""Every task of a plan of several vision tasks (a classifier, a detector, a segmenter over one
backbone) against its unsplit model, in one server.

    python -m blockflow.bench.vision --plan plans/bench_vision.yaml --out DIR

The plan serves each task split (its path's blocks, the backbone shared) and, with
``references: [graph]``, unsplit: the task's network in one process, each part in its block's
precision, in CUDA graphs (a detector's heads, proposals and NMS eagerly after them, as in the
split's last block).
First every task's answer is checked against its fp32 unsplit model on the same images:
classifier and segmenter logits by their largest difference relative to the largest logit (and the
segmenter's per-pixel classes by the share that agree), a detector's detections by its count and
its ten best boxes (each found in the reference with the same label, IoU >= 0.9 and a score within
0.02). Then perf_analyzer over HTTP, host-memory float32 images, batch 1: each figure the median of
``--repeats`` runs ± half their range, p50 at concurrency 1 and throughput at each concurrency.
``DIR/results.json`` and ``DIR/report.md``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from blockflow.bench.agreement import BEST, IOU, SCORE, detections_agree, relative_error
from blockflow.bench.failures import failed_points, failure_cell
from blockflow.bench.harness import commit, device_name, served, task_images, write_results
from blockflow.bench.perf_analyzer import median_of, perf_analyzer, side_input_data
from blockflow.bench.report import spread_text
from blockflow.clients.client import TaskClient
from blockflow.core.spec import BOXES, ORIGINAL_SIZE
from blockflow.plan import Plan, load_plan, naming


def logits_agree(got: npt.NDArray[np.float32], want: npt.NDArray[np.float32]) -> dict[str, float]:
    """The largest difference relative to the largest logit; for maps (``[N, C, H, W]``) also the
    share of pixels whose class agrees."""
    out = {"rel_err": relative_error(got, want)}
    if got.ndim == 4:
        out["pixels_agree"] = float((got.argmax(1) == want.argmax(1)).mean())
    return out


def side_inputs(plan: Plan, name: str, batch: int) -> dict[str, npt.NDArray[Any]]:
    """What task ``name`` takes besides its images: a detector's ORIGINAL_SIZE as the network's own size
    (its boxes as it finds them), ones for any other."""
    model = plan.models[plan.blocks[plan.tasks[name].path[0]].model]
    out = {}
    for s in plan.task_side_inputs(plan.tasks[name]):
        one = np.array(model.input_shape[1:] if s.name == ORIGINAL_SIZE else np.ones(s.shape),
                       dtype=np.int64 if s.dtype == "int64" else np.float32)
        out[s.name] = np.broadcast_to(one, (batch, *one.shape)).copy()
    return out


def check(plan: Plan, url: str, batch: int) -> dict[str, dict[str, float]]:
    """Every task against its fp32 unsplit model, on ``batch`` seeded images."""
    out = {}
    with TaskClient(url) as client:
        for name in plan.tasks:
            x, sides = task_images(plan, name, batch, seed=batch), side_inputs(plan, name, batch)
            # The fp32 unsplit model: served beside the task's own unless the task is fp32 throughout.
            fp32 = naming.fp32_reference(name)
            want = fp32 if fp32 in plan.reference_models(plan.tasks[name]) else plan.reference_models(plan.tasks[name])[0]
            if any(o.name == BOXES for o in plan.block_outputs(plan.blocks[plan.tasks[name].path[-1]])):
                out[name] = detections_agree(client.detect(name, x, inputs=sides), client.detect(want, x, inputs=sides))
            else:
                out[name] = logits_agree(client.infer(name, x, inputs=sides), client.infer(want, x, inputs=sides))
    return out


def run(plan_path: Path, out: Path, concurrencies: list[int], repeats: int, seconds: float, batch: int,
        tasks: list[str] | None = None) -> dict[str, Any]:
    """Check every task, then measure ``tasks`` (default: all); results are written after each task."""
    plan = load_plan(plan_path)
    unknown = sorted(set(tasks or ()) - set(plan.tasks))
    if unknown:
        raise SystemExit(f"{plan_path} has no task {', '.join(unknown)}")
    results: dict[str, Any] = {"meta": {"plan": str(plan_path), "commit": commit(), "device": device_name(), "repeats": repeats,
                                        "seconds": seconds, "concurrency": concurrencies, "check_batch": batch}, "tasks": {}}
    with served(plan, "bench-vision-") as server:
        results["equal"] = check(plan, server.http_url, batch)
        for name, e in results["equal"].items():
            print(f"[vision] {name} against its fp32 unsplit model: {e}", flush=True)
        write_results(out, results, report)
        for name in tasks or list(plan.tasks):
            model = plan.models[plan.blocks[plan.tasks[name].path[0]].model]
            shape = "IMAGE:" + ",".join(str(d) for d in model.image_shape)
            taken = plan.task_side_inputs(plan.tasks[name])  # random int64 would be no valid size: ones
            data = side_input_data(Path(tempfile.mkdtemp(prefix="bench-vision-")), model.image_shape,
                                   model.image is not None and model.image.dtype == "uint8", taken) if taken else None
            row: dict[str, Any] = {}
            unsplit = [m for m in plan.reference_models(plan.tasks[name]) if m != naming.fp32_reference(name)]
            if not unsplit:
                raise SystemExit(f"{plan_path} serves no unsplit model of {name}: give it references: [graph] (or [eager])")
            for label, served_model in (("split", name), ("unsplit", unsplit[-1])):
                perf_analyzer(server.http_url, served_model, shape, 1, 0.5, concurrency=1, input_data=data)  # warm-up, not recorded
                row[label] = {str(c): median_of([perf_analyzer(server.http_url, served_model, shape, 1, seconds, concurrency=c,
                                                               input_data=data) for _ in range(repeats)]) for c in concurrencies}
                print(f"[vision] {name} {label}: " + ", ".join(
                    f"c{c} p50 {r.get('p50_ms', float('nan')):.2f} ms {r.get('throughput', float('nan')):.0f}/s" for c, r in row[label].items()),
                    flush=True)
            results["tasks"][name] = row
            write_results(out, results, report)
    return results


def _cell(r: dict[str, Any], key: str, fmt: str, unit: str) -> str:
    return failure_cell(r) if "error" in r else f"{r[key]:{fmt}}{unit}{spread_text(r, key)}"


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    cs = [str(c) for c in meta["concurrency"]]
    L = [f"# Vision tasks over one backbone: `{meta['plan']}`", "",
         f"{meta['device']}, commit {meta['commit']}; perf_analyzer over HTTP, host-memory float32 images, batch 1, median of "
         f"{meta['repeats']} run(s) of {meta['seconds']:g} s ± half their range. *split*: the task's blocks (the backbone "
         "shared); *unsplit*: its network in one process, each part in its block's precision, in CUDA graphs (a "
         "detector's heads, proposals and NMS eagerly after them, as in the split's last block).", "",
         f"Each task against its fp32 unsplit model ({meta['check_batch']} images):", "",
         "| task | check |", "|---|---|"]
    for task, e in res["equal"].items():
        if "best_matched" in e:
            L.append(f"| {task} | {e['count']:.0f} detections per image, counts within {e['count_diff']:.0f}; "
                     f"{e['best_matched']:.0%} of the {BEST} best found (same label, IoU >= {IOU}, score within {SCORE}) |")
        else:
            L.append(f"| {task} | largest difference {e['rel_err']:.1e} of the largest logit"
                     + (f"; {e['pixels_agree']:.2%} of pixels the same class |" if "pixels_agree" in e else " |"))
    head = " | ".join(f"unsplit c{c} | split c{c} | ratio" for c in cs[1:])
    L += ["", f"| task | unsplit c1 p50 | split c1 p50 | split/unsplit | {head} |",
          "|---|---|---|---|" + "---|---|---|" * len(cs[1:])]
    for task, row in res["tasks"].items():
        u, s = row["unsplit"], row["split"]
        cells = [_cell(u[cs[0]], "p50_ms", ".2f", " ms"), _cell(s[cs[0]], "p50_ms", ".2f", " ms"),
                 f"{s[cs[0]]['p50_ms'] / u[cs[0]]['p50_ms']:.2f}×" if "error" not in u[cs[0]] and "error" not in s[cs[0]] else "-"]
        for c in cs[1:]:
            cells += [_cell(u[c], "throughput", ".0f", "/s"), _cell(s[c], "throughput", ".0f", "/s"),
                      f"{s[c]['throughput'] / u[c]['throughput']:.2f}×" if "error" not in u[c] and "error" not in s[c] else "-"]
        L.append(f"| {task} | " + " | ".join(cells) + " |")
    L += ["", *failed_points([(f"{task} {model} c{c}", row[model][c]) for task, row in res["tasks"].items()
                              for model in ("unsplit", "split") for c in cs])]
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_vision.yaml"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated, the first for p50 (default 1,16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--check-batch", type=int, default=2, help="images per task in the check against the fp32 model")
    ap.add_argument("--tasks", help="comma-separated tasks to measure (default: every task; every task is checked)")
    a = ap.parse_args()
    run(a.plan, a.out, [int(c) for c in a.concurrency.split(",")], a.repeats, a.seconds, a.check_batch,
        a.tasks.split(",") if a.tasks else None)
    print((a.out / "report.md").read_text())


if __name__ == "__main__":
    main()
