"""One setting off and on in traced turns: ``python -m blockflow.bench.timeline`` once per turn, a fresh
server each, with an environment variable or one of its options set to the turn's value, then every
turn's end-to-end times and the split's steps side by side.

    python -m blockflow.bench.lab.traced_turns --env BLOCKFLOW_TMQ_EARLY --values 1,0,1,0 --precision fp16 \\
        --also="--warm-cores-ms 50" --plan PLAN --out DIR

Where ``blockflow.bench.lab.turns`` says whether a setting moves perf_analyzer's figures, this says
which steps of a request it moves. Traced calls are a little slower than untraced ones, and a
turn's server can be slower in every step than its neighbours (these machines drift by up to 40%),
so a step is judged by how it moves against the others and against its neighbouring turns. Each
turn lands in ``DIR/<n>_<value>/`` (``timeline.json``, ``timeline.md``); ``DIR/traced_turns.md``
holds both tables. A turn whose ``timeline.json`` is already there is not run again.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from blockflow.bench.lab.turns import run_turns, setting_parser, turn_names
from blockflow.bench.timeline import step_order


def _finished(turn: Path) -> dict[str, Any] | None:
    try:
        res: dict[str, Any] = json.loads((turn / "timeline.json").read_text())
    except (OSError, ValueError):
        return None
    return res


def summary(out: Path, setting: str, values: list[str], also: list[str] | None = None) -> str:
    """``traced_turns.md``: each turn's end-to-end medians, then each step of the split (µs) per turn."""
    names = turn_names(values)
    done = {n: res for n in names if (res := _finished(out / n)) is not None}
    lines = [f"# `{setting}` in traced turns", ""]
    if not done:
        return "\n".join([*lines, "No turn has finished yet.", ""])
    first = next(iter(done.values()))
    lines += [f"Plan `{first['plan']}`, task `{first['task']}`, {first.get('precision', 'precision not recorded')}; "
              f"{first['device']}; commit {', '.join(sorted({r.get('commit', '?') for r in done.values()}))}; "
              f"{first['requests']} sequential batch-1 requests per model, a fresh server per turn"
              f"{f' (every one with `{shlex.join(also)}`)' if also else ''}; medians.", ""]
    labels = list(first["models"])
    # The split whose steps are shown: TensorMQ's where the plan compares transports.
    splits = [label for label in labels if len(first["models"][label]["stages"]) > 1]
    split = "tensormq" if "tensormq" in splits else next(iter(splits), None)
    base = next((label for label in labels if label != split), None)  # the first reference, for split − reference
    cols = [f"{label} end to end" for label in labels] + ([f"{split} − {base}"] if split and base else [])
    lines += ["| turn | " + " | ".join(cols) + " |", "|---" * (1 + len(cols)) + "|"]
    for turn, (name, value) in enumerate(zip(names, values, strict=True), 1):
        res = done.get(name)
        if res is None:
            lines.append(f"| {turn} {setting}={value} | not finished |")
            continue
        e2e = {label: m["median_ms"].get("end_to_end") for label, m in res["models"].items()}
        cells = [e2e.get(label) for label in labels]
        if split and base:
            a, b = e2e.get(split), e2e.get(base)
            cells.append(a - b if a is not None and b is not None else None)
        lines.append(f"| {turn} {setting}={value} | " + " | ".join(_ms(c) for c in cells) + " |")
    if split is not None:
        seen: dict[str, float] = {}  # every turn's steps (a setting may add some), in the order they first appear
        for res in done.values():
            seen |= {k: v for k, v in res["models"].get(split, {}).get("median_ms", {}).items() if k not in seen}
        steps = step_order(first["models"][split]["stages"], seen)
        lines += ["", f"Steps of `{split}` ({first['models'][split]['model']}), median µs (see `timeline.md` for what each is):", "",
                  "| step | " + " | ".join(f"{i} {setting}={v}" for i, (n, v) in enumerate(zip(names, values, strict=True), 1)
                                             if n in done) + " |",
                  "|---" * (1 + len(done)) + "|"]
        for step in steps:
            cells = [done[n]["models"].get(split, {}).get("median_ms", {}).get(step) for n in names if n in done]
            lines.append(f"| {step} | " + " | ".join("—" if c is None else f"{c * 1e3:.0f}" for c in cells) + " |")
    return "\n".join([*lines, ""])


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f} ms"


def main() -> None:
    ap = setting_parser(__doc__, "`python -m blockflow.bench.timeline`", turn_s=120)
    ap.add_argument("--precision", help="every block in this precision instead of the plan's")
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    run_turns(ap, args, "`python -m blockflow.bench.timeline`",
              lambda turn: [sys.executable, "-m", "blockflow.bench.timeline", "--plan", str(args.plan), "--out", str(turn),
                            "--requests", str(args.requests), *(["--precision", args.precision] if args.precision else [])],
              lambda turn: _finished(turn) is not None,
              lambda setting, values, also: summary(args.out, setting, values, also), "traced_turns.md",
              quiet=True)  # each timeline prints its whole report


if __name__ == "__main__":
    main()
