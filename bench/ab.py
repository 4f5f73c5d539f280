"""Two plans' first tasks in one server, measured in alternation: an A/B within one server.

Fresh servers on these machines differ by more than most changes to a hop (the unsplit graph's c1
p50 moved by up to 0.4 ms between neighbouring servers of one lease), so turns of ``blockflow
bench`` with a fresh server each often cannot tell two settings apart. Here plan A's first task and
plan B's first task are served side by side, each with its own block processes (the names prefixed
``a_`` and ``b_``), beside plan A's unsplit CUDA graph; perf_analyzer measures them one after the
other, round after round, the order reversed every other round, at c1 and c32. Each round gives B
minus A; only one model is measured at a time, so the other copy's processes sit idle.

Whatever differs between the plans must be in their models, blocks or tasks (a block's settings,
its instances, its batching, its precision...); the other top-level settings must be equal.

    python -m blockflow.bench.ab --a plans/bench_r50.yaml --b B.yaml --out DIR [--precision fp16 --rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from blockflow.bench.harness import commit, device_name, served, write_results
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.bench.plans import in_precision
from blockflow.core.errors import BlockFlowError
from blockflow.plan import Plan, load_plan, parse_plan

SIDES = ("a", "b")
SHARED = ("version", "transport", "fuse", "pack", "tensormq")  # top-level settings both plans must agree on


def _side(plan: Plan, prefix: str) -> dict[str, Any]:
    """``plan``'s first task, its blocks and models, renamed with ``prefix``, the plan's defaults
    folded into each block (the merged plan has none of its own)."""
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    task_name, task = next(iter(raw["tasks"].items()))
    defaults = raw.get("defaults", {})
    blocks = {}
    for name in task["path"]:
        block = {**defaults, **raw["blocks"][name], "model": prefix + raw["blocks"][name]["model"]}
        weights = block.get("weights", {})
        if "file" in weights:  # relative to its own plan's directory
            block["weights"] = {**weights, "file": str((plan.base_dir / weights["file"]).resolve())}
        blocks[prefix + name] = block
    models = {prefix + m: raw["models"][m] for m in {raw["blocks"][n]["model"] for n in task["path"]}}
    # The plan's hand_over travels with its task: the merged plan has a side of each kind.
    tasks = {prefix + task_name: {**task, "path": [prefix + n for n in task["path"]], "hand_over": plan.tasks[task_name].hand_over}}
    return {"models": models, "blocks": blocks, "tasks": tasks}


def merged(a: Plan, b: Plan, precision: str | None = None) -> tuple[Plan, dict[str, str]]:
    """One plan serving ``a``'s and ``b``'s first tasks (and ``a``'s unsplit graph); returns it and the
    model each side measures (``a``, ``b``, ``graph``)."""
    ra, rb = (p.raw.model_dump(mode="json", exclude_none=True) for p in (a, b))
    differ = [k for k in SHARED if ra.get(k) != rb.get(k)]
    if differ:
        raise BlockFlowError(f"plans {a.source} and {b.source} differ in {', '.join(differ)}: "
                             "an A/B in one server needs them to differ in models, blocks or tasks only")
    sides = {s: _side(p, f"{s}_") for s, p in zip(SIDES, (a, b), strict=True)}
    raw: dict[str, Any] = {k: ra[k] for k in SHARED if k in ra}
    raw.update(name=f"ab-{ra.get('name', 'a')}-{rb.get('name', 'b')}", compare=[], references=["graph"])
    for key in ("models", "blocks", "tasks"):
        raw[key] = {k: v for s in SIDES for k, v in sides[s][key].items()}
    plan = parse_plan(raw, source=f"{a.source} and {b.source} side by side", base_dir=a.base_dir)
    if precision:
        plan = in_precision(plan, precision)
    ta, tb = (next(iter(sides[s]["tasks"])) for s in SIDES)
    # Plan A's unsplit graph only: plan B's, served too, sits idle.
    return plan, {"a": ta, "b": tb, "graph": f"{ta}__ref_graph"}


def run(a: Path, b: Path, out: Path, precision: str | None, rounds: int, seconds: float,
        concurrency: tuple[int, ...] = (1, 32), warm_cores_ms: float = 0.0) -> dict[str, Any]:
    plan, models = merged(load_plan(a), load_plan(b), precision)
    c, h, w = plan.block_in_shape(plan.blocks[plan.tasks[models["a"]].path[0]])
    shape = f"IMAGE:{c},{h},{w}"
    runs: dict[str, list[dict[str, float]]] = {}
    result: dict[str, Any] = {"meta": {"device": device_name(), "commit": commit(), "a": str(a), "b": str(b),
                                       "precision": precision, "rounds": rounds, "seconds": seconds, "models": models,
                                       "warm_cores_ms": warm_cores_ms},
                              "runs": runs}
    with served(plan, "bench-ab-", warm_cores_ms=warm_cores_ms) as server:
        for model in models.values():  # warm-up, not recorded
            perf_analyzer(server.http_url, model, shape, 1, seconds, concurrency=1)
        for i in range(rounds):
            order = list(models) if i % 2 == 0 else list(models)[::-1]
            for conc in concurrency:
                for side in order:
                    r = perf_analyzer(server.http_url, models[side], shape, 1, seconds, concurrency=conc)
                    if "error" in r:
                        raise BlockFlowError(f"perf_analyzer on {models[side]} at c{conc}: {r.get('message', r)}")
                    runs.setdefault(f"{side}|c{conc}", []).append(r)
                    write_results(out, result, report)  # a run cut short keeps its rounds
    return write_results(out, result, report)


def summary(runs: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Per concurrency: each side's median, and B − A (c1: p50 ms; else inferences/s) per round."""
    rows = []
    for conc in sorted({int(k.split("|c")[1]) for k in runs}):
        key = "p50_ms" if conc == 1 else "throughput"
        got = {s: [r[key] for r in runs.get(f"{s}|c{conc}", [])] for s in (*SIDES, "graph")}
        n = min(len(got["a"]), len(got["b"]))
        diffs = [got["b"][i] - got["a"][i] for i in range(n)]
        rows.append({"concurrency": conc, "figure": key, **{s: statistics.median(v) if v else None for s, v in got.items()},
                     "b_minus_a": diffs, "b_lower": sum(d < 0 for d in diffs)})
    return rows


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [f"# A/B in one server on {meta['device']}, commit {meta['commit']}", "",
             f"A: `{meta['a']}`, B: `{meta['b']}` (first tasks `{meta['models']['a']}` and `{meta['models']['b']}`), "
             f"precision {meta['precision'] or 'as planned'}; perf_analyzer over HTTP, batch 1, {meta['seconds']} s windows, "
             f"alternating, {meta['rounds']} rounds, warm cores {meta.get('warm_cores_ms') or 'off'}"
             f"{' ms' if meta.get('warm_cores_ms') else ''}; medians, and B − A in each round.", "",
             "| concurrency | figure | A | B | unsplit graph (A) | B − A per round | rounds with B − A < 0 |", "|---|---|---|---|---|---|---|"]

    def fmt(v: float | None, key: str) -> str:
        return "—" if v is None else (f"{v:.3f} ms" if key == "p50_ms" else f"{v:.0f}/s")

    for r in summary(res["runs"]):
        per = ", ".join(f"{d:+.3f}" if r["figure"] == "p50_ms" else f"{d:+.0f}" for d in r["b_minus_a"])
        lines.append(f"| c{r['concurrency']} | {r['figure']} | {fmt(r['a'], r['figure'])} | {fmt(r['b'], r['figure'])} | "
                     f"{fmt(r['graph'], r['figure'])} | {per} | {r['b_lower']} of {len(r['b_minus_a'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="plan A (its first task is measured)")
    ap.add_argument("--b", type=Path, required=True, help="plan B (its first task is measured)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--precision", default=None, help="every block in this precision (default: as planned)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=1.0, help="perf_analyzer's measurement window")
    ap.add_argument("--concurrency", default="1,32", help="comma-separated, e.g. 1 or 1,32")
    ap.add_argument("--warm-cores-ms", type=float, default=0.0, help="as blockflow serve --warm-cores-ms (default off)")
    args = ap.parse_args()
    conc = tuple(int(c) for c in args.concurrency.split(","))
    print(report(run(args.a, args.b, args.out, args.precision, args.rounds, args.seconds, conc, args.warm_cores_ms)))


if __name__ == "__main__":
    main()
