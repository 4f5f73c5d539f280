"""What the HTTP front door costs: the same task served with nginx before Triton's HTTP and without it.

Without the front door, Triton's HTTP listens on the port itself, open to the chunked requests that crash
Triton 2.51 (blockflow.triton.front_door); that server exists here only to be measured against. Fresh servers
alternate (with, without, without, with, ...) so that drift between servers falls on both sides alike; each
serves the plan's first task split and unsplit (its CUDA graph). perf_analyzer over HTTP with host inputs
measures c1 p50 and c32 throughput of each; the report gives each side's median over the turns, the spread,
and the front door's difference. With the front door, the same points are measured with CUDA and system
shared-memory inputs too, registered through the server's shared-memory key (a request then carries no image).

    python -m blockflow.bench.front_door --out DIR [--plan plans/bench_r50.yaml --precision fp16 --turns 2]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from blockflow.bench.harness import commit, device_name, served, write_results
from blockflow.bench.perf_analyzer import INPUTS, perf_analyzer
from blockflow.bench.plans import split_and_graph
from blockflow.plan import load_plan, naming

SIDES = {"front door": True, "direct": False}


def measure(plan_path: Path, precision: str | None, turns: int, seconds: float, shm: bool = True) -> dict[str, Any]:
    plan = split_and_graph(load_plan(plan_path), precision)
    task = next(iter(plan.tasks.values()))
    c, h, w = plan.block_in_shape(plan.blocks[task.path[0]])
    models = {"split": task.name, "unsplit graph": naming.reference_model(task.name, graph=True)}
    rows: list[dict[str, Any]] = []
    for turn in range(turns):
        order = list(SIDES) if turn % 2 == 0 else list(reversed(SIDES))
        for side in order:
            with served(plan, "bench-door-", front_door=SIDES[side]) as server:
                for memory in INPUTS if SIDES[side] and shm else ("host",):
                    for label, model in models.items():
                        def run(secs: float, conc: int, m: str = model, mem: str = memory, key: Path = server.shm_key_file) -> dict[str, Any]:
                            return perf_analyzer(server.http_url, m, f"IMAGE:{c},{h},{w}", 1, secs, conc, input_memory=mem,
                                                 output_bytes=400_000, shm_key_file=key)

                        run(seconds / 2, 1)  # warm-up
                        c1, c32 = run(seconds, 1), run(seconds, 32)
                        rows.append({"turn": turn, "side": side if memory == "host" else f"{side}, {memory}", "model": label,
                                     "c1_p50_ms": c1.get("p50_ms"), "c32_throughput": c32.get("throughput"),
                                     **({"error": 1} if "error" in c1 or "error" in c32 else {})})
                        print(f"[front_door] turn {turn} {side:10s} {memory:10s} {label:13s} c1 p50 {c1.get('p50_ms')} ms, "
                              f"c32 {c32.get('throughput')}/s", flush=True)
    return {"meta": {"commit": commit(), "device": device_name(), "plan": str(plan_path), "precision": precision or "as planned",
                     "turns": turns, "seconds": seconds, "input": "host memory, perf_analyzer over HTTP, batch 1"},
            "rows": rows, "summary": summary(rows)}


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """model -> side -> figure -> {median, spread}: spread is (max - min) / median over the turns."""
    values: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in rows:
        if "error" not in r:
            for key in ("c1_p50_ms", "c32_throughput"):
                values.setdefault(r["model"], {}).setdefault(r["side"], {}).setdefault(key, []).append(float(r[key]))
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for model, sides in values.items():
        for side, figures in sides.items():
            for key, vs in figures.items():
                mid = statistics.median(vs)
                out.setdefault(model, {}).setdefault(side, {})[key] = {"median": mid, "spread": (max(vs) - min(vs)) / mid if mid else 0.0}
    return out


def report(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [f"# The HTTP front door's cost ({m['device']}, commit {m['commit']})", "",
             f"Plan `{m['plan']}` in {m['precision']}; {m['input']}; {m['turns']} turns of a fresh server each side, "
             f"alternating; median over the turns (± half the spread).", "",
             "| model | c1 p50 direct | c1 p50 front door | difference | c32 direct | c32 front door | ratio |",
             "|---|---|---|---|---|---|---|"]

    def fig(d: dict[str, float], unit: str) -> str:
        return f"{d['median']:.3f} {unit} ±{d['spread'] * 50:.0f}%" if unit == "ms" else f"{d['median']:.0f}/s ±{d['spread'] * 50:.0f}%"

    shm_rows = []
    for model, sides in result["summary"].items():
        for side, figures in sides.items():
            if side not in SIDES:
                shm_rows.append(f"| {model} | {side.split(', ')[1]} | {fig(figures['c1_p50_ms'], 'ms')} | "
                                f"{fig(figures['c32_throughput'], '/s')} |")
        if not set(SIDES) <= set(sides):
            lines.append(f"| {model} | failed on a side | | | | | |")
            continue
        d, f = sides["direct"], sides["front door"]
        lines.append(f"| {model} | {fig(d['c1_p50_ms'], 'ms')} | {fig(f['c1_p50_ms'], 'ms')} | "
                     f"{(f['c1_p50_ms']['median'] - d['c1_p50_ms']['median']) * 1e3:+.0f} us | {fig(d['c32_throughput'], '/s')} | "
                     f"{fig(f['c32_throughput'], '/s')} | {f['c32_throughput']['median'] / d['c32_throughput']['median']:.3f} |")
    if shm_rows:
        lines += ["", "With the front door, inputs and outputs through shared memory (registered with the shared-memory key):", "",
                  "| model | input | c1 p50 | c32 |", "|---|---|---|---|", *shm_rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--no-shm", action="store_true", help="host-memory inputs only (no GPU needed)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = write_results(args.out, measure(args.plan, args.precision, args.turns, args.seconds, not args.no_shm), report)
    print(report(result))


if __name__ == "__main__":
    main()
