"""The split against the unsplit model, like for like, in one command: ``blockflow bench`` once per row
(precision and client input path, one server each, references in the row's precision), then one table
of every row with the targets of the split's cost checked against it.

    python -m blockflow.bench.like_for_like --plan plans/bench_r50.yaml --out DIR

Each row lands in ``DIR/<row>/`` (``results.json``, ``report.md``); ``DIR/like_for_like.md`` is the
table. A row whose complete ``results.json`` is already there is not measured again, so a run cut
short (a machine's time limit) goes on where it stopped; ``--summary`` only writes the table.
Figures: the median of ``--repeats`` perf_analyzer runs ± half their range, batch 1, p50 at
concurrency 1 and throughput at concurrency 32 (and the best throughput over ``--concurrency``);
hop = (split − mono) / hops.

A row of uint8 images (``fp16_u8_host``...) and ``--instances N`` (the task's first block, and so
the unsplit model, in N instances) serve a copy of the plan with those settings, written into the
row's directory as ``plan.yaml`` (a plan with relative file paths cannot be copied: give absolute ones).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from blockflow.bench.report import alone_b32, gpu_alone, split_rows, spread_text


@dataclass(frozen=True)
class Row:
    name: str  # its directory under --out
    label: str  # its first cell
    precision: str
    input: str  # blockflow bench --input
    # The task's image: as the plan says, "uint8" (CHW) or "encoded" (JPEG/PNG files), ImageNet-normalised on the GPU.
    image: str = "plan"


ROWS = (Row("fp16_host", "fp16, host memory", "fp16", "host"),
        Row("fp16_cudashm", "fp16, CUDA shared memory", "fp16", "cuda-shm"),
        Row("tf32_host", "tf32, host memory", "tf32", "host"),
        Row("fp32_host", "fp32, host memory", "fp32", "host"),
        Row("tf32_cudashm", "tf32, CUDA shared memory", "tf32", "cuda-shm"),
        Row("fp32_cudashm", "fp32, CUDA shared memory", "fp32", "cuda-shm"),
        Row("fp16_u8_host", "fp16, uint8 images, host memory", "fp16", "host", "uint8"),
        Row("fp16_u8_cudashm", "fp16, uint8 images, CUDA shared memory", "fp16", "cuda-shm", "uint8"),
        Row("fp16_jpeg_host", "fp16, JPEG files, host memory", "fp16", "host", "encoded"))
DEFAULT_ROWS = ROWS[:6]
SPLIT, MONO, OTHERS = "tensormq", "monolithic-graph", ("triton-gpu", "triton-cpu")
# The targets (docs/benchmarking.md, "Like with like"): a hop at c1; split/mono p50 at c1 (at most, by client input path);
# split/mono throughput at c32 and, where higher concurrencies ran, of each model's best (at least); each model's best
# throughput as a share of the GPU alone at batch 32.
HOP_MS = 0.22
C1_RATIO = {"host": 1.3, "cuda-shm": 1.35}
C32_RATIO = 0.95
ALONE_SHARE = 0.60
HEADER = ["| precision, client input | monolithic CUDA graph | 4-block `tensormq` | split/mono p50, c32 | hop | `triton-gpu` | `triton-cpu` |",
          "|---|---|---|---|---|---|---|"]
# The column runs with the GPU alone's figures (blockflow.bench.gpu_alone) add; tables of runs without them keep their bytes.
GPU_ALONE_HEADER = [" served / GPU alone (b32) |", "---|"]


def row_plan(row: Row, plan: Path, out: Path, instances: int | None, rest: int | None = None) -> Path:
    """The plan ``row`` serves: ``plan`` itself, or a copy in the row's directory with every model's
    image in uint8, the first block of every task in ``instances`` instances and its other blocks in ``rest``."""
    if row.image == "plan" and instances is None and rest is None:
        return plan
    raw = yaml.safe_load(plan.read_text())
    if row.image != "plan":
        for model in raw["models"].values():
            model["input"] = {"dtype": row.image, "normalize": "imagenet"}
    if instances is not None:
        raw.pop("reference_instances", None)  # the unsplit model as the first block, as the row says
    for task in raw["tasks"].values():
        for k, block in enumerate(task["path"]):
            if (n := instances if k == 0 else rest) is not None:
                raw["blocks"][block]["instances"] = n
    copy = out / row.name / "plan.yaml"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(f"# {plan} as row {row.name} serves it" + (f", first blocks in {instances} instances" if instances else "")
                    + (f", the others in {rest}" if rest else "")
                    + "\n" + yaml.safe_dump(raw, sort_keys=False))
    return copy


def bench_command(row: Row, plan: Path, out: Path, repeats: int, seconds: float, mps: bool,
                  concurrency: str = "1,32", client_threads: int = 0) -> list[str]:
    return [sys.executable, "-m", "blockflow", "bench", "--plan", str(plan), "--precision", row.precision,
            *(["--input", row.input] if row.input != "host" else []), "--sections", "concurrency", "--concurrency", concurrency,
            "--seconds", f"{seconds:g}", "--repeats", str(repeats), *(["--mps"] if mps else []),
            *(["--client-threads", str(client_threads)] if client_threads else []), "--out", str(out / row.name)]


def checkpointed(out: Path, row: Row) -> dict[str, Any] | None:
    """A row's results so far: its run's last checkpoint (``meta.complete`` says whether it finished)."""
    try:
        res: dict[str, Any] = json.loads((out / row.name / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return res


def finished(out: Path, row: Row) -> dict[str, Any] | None:
    """A row's results, if its run finished."""
    res = checkpointed(out, row)
    return res if res is not None and res.get("meta", {}).get("complete", False) else None


def measured_figure(conc: dict[str, Any], model: str, c: str) -> dict[str, Any] | None:
    """``model``'s figures at concurrency ``c``, if it was measured there and did not fail."""
    fig: dict[str, Any] | None = conc.get(model, {}).get(c)
    return fig if fig is not None and "error" not in fig else None


def _failed(conc: dict[str, Any], model: str) -> bool:
    """Whether ``model`` ran and failed: an ``error`` at a concurrency, or none measured. A run that measured
    neither c1 nor c32 (``--concurrency 256``) is not a failure: its cells say "—"."""
    runs = conc.get(model)
    if runs is None:
        return False
    return not runs or any("error" in fig for fig in runs.values())


def _c1_c32(conc: dict[str, Any], model: str, throughput_spread: bool = True) -> str:
    """``p50 at c1 (throughput at c32)``; a run at one concurrency only (``--concurrency 1`` in turns) shows that one."""
    if _failed(conc, model):
        return "failed"
    c1, c32 = measured_figure(conc, model, "1"), measured_figure(conc, model, "32")
    if c1 is None and c32 is None:
        return "—"
    text = f"{c1['p50_ms']:.2f} ms{spread_text(c1, 'p50_ms')}" if c1 is not None else "—"
    if c32 is not None:
        text += f" ({c32['throughput']:.0f}/s{spread_text(c32, 'throughput') if throughput_spread else ''})"
    return text


def table_row(row: Row, res: dict[str, Any]) -> tuple[str, dict[str, float] | None]:
    """The row's line of the table, and its split/mono c1 ratio, c32 ratio and hop (None where either model
    failed; a ratio at a concurrency that was not measured is left out)."""
    conc = res["concurrency"]
    if _failed(conc, SPLIT) or _failed(conc, MONO) or SPLIT not in conc or MONO not in conc:
        cells = [row.label, _c1_c32(conc, MONO), _c1_c32(conc, SPLIT), "—", "—", *(_c1_c32(conc, m, False) for m in OTHERS)]
        return "| " + " | ".join(cells) + " |", None
    figures: dict[str, float] = {}
    if (s1 := measured_figure(conc, SPLIT, "1")) is not None and (m1 := measured_figure(conc, MONO, "1")) is not None:
        hops = max(1, len(res.get("path", [])) - 1)
        figures |= {"c1_ratio": s1["p50_ms"] / m1["p50_ms"], "hop_ms": (s1["p50_ms"] - m1["p50_ms"]) / hops}
    if (s32 := measured_figure(conc, SPLIT, "32")) is not None and (m32 := measured_figure(conc, MONO, "32")) is not None:
        figures["c32_ratio"] = s32["throughput"] / m32["throughput"]
    if _beyond_c32(conc) and (sb := best(conc, SPLIT)) is not None and (mb := best(conc, MONO)) is not None:
        figures["best_ratio"] = sb[0] / mb[0]  # each model at its best concurrency (the throughput target)
    ratios = ", ".join(f"{figures[k]:.2f}×" if k in figures else "—" for k in ("c1_ratio", "c32_ratio"))
    if "best_ratio" in figures:
        ratios += f"; bests {figures['best_ratio']:.2f}×"
    cells = [row.label, _c1_c32(conc, MONO), _c1_c32(conc, SPLIT), ratios,
             f"{figures['hop_ms']:.2f} ms" if "hop_ms" in figures else "—",
             *(_c1_c32(conc, m, throughput_spread=False) for m in OTHERS)]
    return "| " + " | ".join(cells) + " |", figures


def _beyond_c32(conc: dict[str, Any]) -> bool:
    """Whether either model was measured at a concurrency other than 1 and 32 (its best may lie there)."""
    return any(set(conc.get(m, {})) - {"1", "32"} for m in (SPLIT, MONO))


def best(conc: dict[str, Any], model: str) -> tuple[float, str] | None:
    """``model``'s highest throughput over the concurrencies measured, and that concurrency."""
    figs = [(fig["throughput"], c) for c in conc.get(model, {}) if (fig := measured_figure(conc, model, c)) is not None]
    return max(figs, key=lambda f: f[0]) if figs else None


def _bests(conc: dict[str, Any]) -> list[tuple[str, tuple[float, str]]]:
    """``("unsplit" | "split", (best throughput, its concurrency))`` of each model measured."""
    return [(label, b) for label, m in (("unsplit", MONO), ("split", SPLIT)) if (b := best(conc, m)) is not None]


def served_over_alone(res: dict[str, Any]) -> str:
    """The split's throughput at c32 as a share of the GPU alone's at batch 32 (``meta.gpu_alone``), and where more
    concurrencies were measured, each model's best as a share of it; "—" without the GPU alone's figure."""
    b32 = alone_b32(res)
    conc = res["concurrency"]
    fig = None if _failed(conc, SPLIT) else measured_figure(conc, SPLIT, "32")
    if not b32 or (fig is None and not _beyond_c32(conc)):
        return "—"
    texts = [] if fig is None else [f"{100 * fig['throughput'] / b32:.0f}% of {b32:,.0f}/s"]
    if _beyond_c32(conc):
        bests = _bests(conc)
        texts.append(("best " if fig is not None else f"of {b32:,.0f}/s, best ")
                     + ", ".join(f"{label} {b[0]:.0f}/s = {100 * b[0] / b32:.0f}% (c{b[1]})" for label, b in bests))
    return "; ".join(texts)


def alone_checks(res: dict[str, Any]) -> str:
    """"; best of the unsplit model / the split against the GPU alone ..." where the GPU alone was measured."""
    b32 = alone_b32(res)
    if not b32:
        return ""
    bests = _bests(res["concurrency"])
    return "".join(f"; {label} best / GPU alone {_verdict(b[0] / b32, ALONE_SHARE, False, '')}" for label, b in bests)


def _verdict(value: float, target: float, at_most: bool, unit: str = "×") -> str:
    met = value <= target if at_most else value >= target
    # Three decimals: 1.301 misses 1.3, which two would show as 1.30.
    return f"{value:.3f}{unit} ({'meets' if met else 'misses'} {'≤' if at_most else '≥'} {target:g}{unit})"


def started_span(metas: list[dict[str, Any]]) -> str:
    """``EARLIEST to LATEST`` of the runs' start dates: rows and turns run in any order, and a run may resume another's."""
    dates = sorted(m["date"] for m in metas)
    return f"{dates[0]} to {dates[-1]}"


def client_phrase(threads: list[int]) -> str:
    """How the rows ran perf_analyzer, for the summary's first paragraph: nothing for its default (a thread per
    request), else each way (``--client-threads``), and that the rows differ where resumed rows did."""
    if threads == [0]:
        return ""
    ways = " and ".join("perf_analyzer a thread per request" if n == 0 else f"perf_analyzer on {n} threads" for n in threads)
    return ways + (" (the rows differ); " if len(threads) > 1 else "; ")


def summary(out: Path, rows: tuple[Row, ...] = DEFAULT_ROWS) -> str:
    """``like_for_like.md``: what was measured, the table and each row against the targets."""
    done = [(row, res) for row in rows if (res := finished(out, row)) is not None]
    lines = ["# Like for like: the split against the unsplit model", ""]
    if not done:
        return "\n".join([*lines, "No row has finished yet.", ""])
    metas = [res["meta"] for _, res in done]
    commits = sorted({m.get("commit", "?") for m in metas})
    client = client_phrase(sorted({int(m.get("client_threads", 0)) for m in metas}))
    beyond = any(_beyond_c32(res["concurrency"]) for _, res in done)
    bests = "; `bests`: each model's highest throughput over the concurrencies measured" if beyond else ""
    by_plan: dict[str, list[str]] = {}
    for row, res in done:
        by_plan.setdefault(res["meta"]["plan"], []).append(row.name)
    # Rows may serve different copies of a plan (the speed command gives host-heavy rows more first-block instances).
    where = (f"Plan `{metas[0]['plan']}`" if len(by_plan) == 1 else
             "Plans " + ", ".join(f"`{plan}` ({', '.join(names)})" for plan, names in by_plan.items()))
    lines += [f"{where}, task `{done[0][1]['task']}` = {' → '.join(done[0][1]['path'])}; {metas[0]['device']}; "
              f"commit {', '.join(commits)}; rows started {started_span(metas)}; MPS {'on' if metas[0].get('mps') else 'off'}; "
              f"{client}"
              f"each row one server, references in its precision; median of {metas[0].get('repeats', 1)} runs ± half their "
              f"range, batch 1: p50 at concurrency 1 (throughput at 32{bests}). Compare within a row: these machines drift by up "
              "to 40%.",
              ""]
    alone = any(gpu_alone(res) for _, res in done)
    if alone:
        lines += [f"served / GPU alone (b32): the split's throughput at c32{' (and each model at its best)' if beyond else ''} "
                  "against the task's whole network in a plain process at batch 32, same precision, channels-last, CUDA graph "
                  "(each row's `meta.gpu_alone`; with JPEG files, its decoding included).", ""]
    lines += [h + g for h, g in zip(HEADER, GPU_ALONE_HEADER, strict=True)] if alone else HEADER
    checks = []
    for row, res in done:
        line, f = table_row(row, res)
        lines.append(line + f" {served_over_alone(res)} |" if alone else line)
        # The rows run at c1 and at c32 or above: a figure missing is a failure.
        if f is None or not {"c1_ratio", "hop_ms"} <= set(f) or not {"c32_ratio", "best_ratio"} & set(f):
            checks.append(f"- {row.label}: not compared, the split or the unsplit model failed (its report.md says why)")
            continue
        throughput = (f"; c32 {_verdict(f['c32_ratio'], C32_RATIO, False)}" if "c32_ratio" in f else "") + (
            f"; bests {_verdict(f['best_ratio'], C32_RATIO, False)}" if "best_ratio" in f else "")
        checks.append(f"- {row.label}: hop {_verdict(f['hop_ms'], HOP_MS, True, ' ms')}; split/mono c1 "
                      f"{_verdict(f['c1_ratio'], C1_RATIO[row.input], True)}{throughput}" + alone_checks(res))
    missing = [row.name for row in rows if row not in {r for r, _ in done}]
    lines += ["", "Against the targets:", "", *checks, ""]
    if missing:
        lines += [f"Not measured yet: {', '.join(missing)} (run the same command again).", ""]
    # blockflow bench's own split table, for the rows' pipeline sections (another window at c1).
    lines += ["Each row's `report.md` has the rest (Triton's per-block statistics, GPU utilisation, energy); its split "
              "table also gives the pipeline section's c1 figures: " + "; ".join(
                  f"{row.name} {r['p50_ratio']:.2f}×" for row, res in done for r in split_rows(res) if r["transport"] == SPLIT) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default=",".join(r.name for r in DEFAULT_ROWS),
                    help=f"which rows, comma-separated (default: the first six; all: {', '.join(r.name for r in ROWS)})")
    ap.add_argument("--instances", type=int, default=None, help="serve each task's first block (and so its unsplit model) in N instances")
    ap.add_argument("--rest-instances", type=int, default=None, help="serve each task's other blocks in N instances")
    ap.add_argument("--concurrency", default="1,32", help="perf_analyzer's concurrencies (1, and 32 or more: the targets read them)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="perf_analyzer's measurement window")
    ap.add_argument("--mps", action="store_true", help="each row's server under MPS (blockflow bench --mps)")
    ap.add_argument("--client-threads", type=int, default=0, choices=range(257), metavar="N",
                    help="perf_analyzer's loop on N threads, 0-256 (blockflow bench --client-threads)")
    ap.add_argument("--summary", action="store_true", help="only write like_for_like.md from the rows already measured")
    args = ap.parse_args()
    by_name = {r.name: r for r in ROWS}
    unknown = [n for n in args.rows.split(",") if n not in by_name]
    if unknown:
        ap.error(f"unknown rows {unknown}; rows: {', '.join(by_name)}")
    levels = args.concurrency.split(",")
    if "1" not in levels or not any(c.isdigit() and int(c) >= 32 for c in levels):
        ap.error("--concurrency must include 1 and one of 32 or more (the targets read c1 and the throughput there)")
    rows = tuple(by_name[n] for n in args.rows.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if args.summary or finished(args.out, row) is not None:
            continue
        plan = row_plan(row, args.plan, args.out, args.instances, args.rest_instances)
        cmd = bench_command(row, plan, args.out, args.repeats, args.seconds, args.mps, args.concurrency, args.client_threads)
        print(f"[like-for-like] {row.name}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True)
        (args.out / "like_for_like.md").write_text(summary(args.out, rows))  # after each row: a cut-short run keeps it
    (args.out / "like_for_like.md").write_text(summary(args.out, rows))
    print((args.out / "like_for_like.md").read_text())


if __name__ == "__main__":
    main()
