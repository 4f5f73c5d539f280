"""One setting off and on in turns, like for like: ``blockflow bench`` once per turn, a fresh server
each, with an environment variable or one of its options set to the turn's value, then one table of
every turn.

    python -m blockflow.bench.lab.turns --env BLOCKFLOW_TMQ_EARLY --values 0,1,0,1 --row fp16_host --plan PLAN --out DIR
    python -m blockflow.bench.lab.turns --option=--warm-cores-ms --values 0,50,0,50 --plan PLAN --out DIR
    python -m blockflow.bench.lab.turns --env BLOCKFLOW_TMQ_OVERLAP --values 0,1,0,1 --also="--warm-cores-ms 50" --plan PLAN --out DIR
    python -m blockflow.bench.lab.turns --option=--plan --values A.yaml,B.yaml,B.yaml,A.yaml --out DIR   # two plans

These machines drift by up to 40% between leases and by several percent within one, so a setting is
judged by turns on one machine, each against its neighbouring turns of the other value; a single
before/after pair proves nothing. Each turn lands in ``DIR/<n>_<value>/<row>/`` (``results.json``,
``report.md``); ``DIR/turns.md`` is the table, with each turn's split c1 p50 against the mean of its
neighbours of another value. A turn whose complete ``results.json`` is already there is not run again.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockflow.bench.like_for_like import (
    HEADER,
    MONO,
    ROWS,
    SPLIT,
    Row,
    bench_command,
    checkpointed,
    finished,
    measured_figure,
    started_span,
    table_row,
)
from blockflow.triton.process_group import run_child


def turn_names(values: list[str]) -> list[str]:
    """Each turn's directory: its number and its value, spelled for a file name (a plan's path, say)."""
    return [f"{i}_{re.sub(r'[^A-Za-z0-9_.-]', '_', v)}" for i, v in enumerate(values, 1)]


def turn_call(cmd: list[str], env: str | None, option: str | None, value: str) -> tuple[list[str], dict[str, str]]:
    """A turn's ``blockflow bench`` command and environment: ``env`` set to ``value``, or ``option value`` added."""
    environ = dict(os.environ)
    if env:
        environ[env] = value
        return cmd, environ
    assert option is not None, "a turn sets an environment variable or an option"
    return [*cmd, option, value], environ


def summary(out: Path, setting: str, values: list[str], row: Row, also: list[str] | None = None) -> str:
    """``turns.md``: the table of the turns that finished and each turn against its neighbours
    (``setting``: the environment variable or option the turns set; ``also``: arguments every turn's bench had)."""
    names = turn_names(values)
    # Turns cut short (past their limit) count with the rows they finished: their bench checkpoints its results.
    done: dict[str, dict[str, Any]] = {n: res for n in names if (res := measured(out / n, row)) is not None}
    lines = [f"# `{setting}` in turns: {row.label}", ""]
    if not done:
        return "\n".join([*lines, "No turn has measured anything yet.", ""])
    metas = [res["meta"] for res in done.values()]
    lines += [f"Plan `{metas[0]['plan']}`, task `{next(iter(done.values()))['task']}`; {metas[0]['device']}; commit "
              f"{', '.join(sorted({m.get('commit', '?') for m in metas}))}; turns started {started_span(metas)}; "
              f"a fresh server per turn{f' (every one with `{shlex.join(also)}`)' if also else ''}; "
              f"median of {metas[0].get('repeats', 1)} runs ± half their range, batch 1.", "",
              "| turn | " + HEADER[0].lstrip("| "), "|---" + HEADER[1]]
    c1: dict[str, float] = {}
    for turn, (name, value) in enumerate(zip(names, values, strict=True), 1):
        if name not in done:
            lines.append(f"| {turn} | {setting}={value}: not finished |")
            continue
        cut = "" if done[name]["meta"].get("complete", True) else " (cut short)"
        line, _ = table_row(Row(row.name, f"{setting}={value}{cut}", row.precision, row.input), done[name])
        lines.append(f"| {turn} {line}")
        # c1 from the concurrency section, else from the batch section's batch 1 (a turn run under load only)
        at_c1 = measured_figure(done[name]["concurrency"], SPLIT, "1") or measured_figure(done[name].get("batch", {}), SPLIT, "1") or {}
        if "p50_ms" in at_c1:
            c1[name] = at_c1["p50_ms"]
    lines += load_table(setting, values, names, done)
    lines += ["", f"The split's c1 p50 in each turn (a turn run under load only: its batch section's batch 1) against the mean of "
              f"its neighbouring turns of another value (`{MONO}` moves too):", ""]
    deltas: dict[str, list[float]] = {}
    for i, name in enumerate(names):
        value = values[i]
        near = [c1[names[j]] for j in (i - 1, i + 1) if 0 <= j < len(names) and values[j] != value and names[j] in c1]
        if name in c1 and near:
            d = c1[name] - statistics.mean(near)
            deltas.setdefault(value, []).append(d)
            lines.append(f"- turn {i + 1} ({setting}={value}): {c1[name]:.2f} ms, {d:+.2f} ms")
    for value, ds in deltas.items():
        lines.append(f"- {setting}={value}: median {statistics.median(ds):+.2f} ms over {len(ds)} turns, lower in {sum(d < 0 for d in ds)}")
    return "\n".join([*lines, ""])


def measured(out: Path, row: Row) -> dict[str, Any] | None:
    """A turn's results so far (what its bench checkpointed, all of it if it finished)."""
    res = checkpointed(out, row)
    if res is None or "meta" not in res or "task" not in res:
        return None
    res.setdefault("concurrency", {})
    return res


def load_table(setting: str, values: list[str], names: list[str], done: dict[str, dict[str, Any]]) -> list[str]:
    """Each finished turn at the highest concurrency both models ran: throughput, the split's ratio, host CPU
    and GPU energy per inference, so a lever that moves load and not c1 shows in ``turns.md`` too."""
    rows = []
    for turn, (name, value) in enumerate(zip(names, values, strict=True), 1):
        conc = done.get(name, {}).get("concurrency", {})
        both = [c for c in conc.get(MONO, {}) if all("throughput" in (measured_figure(conc, m, c) or {}) for m in (MONO, SPLIT))]
        if not both:
            continue
        c = max(both, key=int)
        mono, split = conc[MONO][c], conc[SPLIT][c]

        def cpu(r: dict[str, Any]) -> str:
            h = r.get("host_cpu_ms_per_inference")
            return f"{h['total']:.3f} ({h['own_blocks']:.3f})" if h else "—"

        def mj(r: dict[str, Any]) -> str:
            return f"{r['energy_mj_per_inference']:.1f}" if "energy_mj_per_inference" in r else "—"

        rows.append(f"| {turn} | {setting}={value} | c{c} | {mono['throughput']:.0f} | {split['throughput']:.0f} | "
                    f"{split['throughput'] / mono['throughput'] if mono['throughput'] else float('nan'):.2f}× | {cpu(mono)} | {cpu(split)} | {mj(mono)} | {mj(split)} |")
    if not rows:
        return []
    return ["", "Under load (the highest concurrency both ran without error; host CPU ms per inference, in all and in the model's own "
            "block processes; GPU energy mJ per inference):", "",
            f"| turn | setting | concurrency | {MONO} /s | split /s | split/mono | {MONO} CPU | split CPU | {MONO} mJ | split mJ |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows]


def setting_parser(doc: str | None, tool: str, turn_s: float) -> argparse.ArgumentParser:
    """The arguments every kind of turns takes: the setting (``--env`` or ``--option`` of ``tool``),
    its ``--values``, ``--plan``, ``--out``, ``--also`` and ``--turn-s``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    setting = ap.add_mutually_exclusive_group(required=True)
    setting.add_argument("--env", help="the environment variable the turns set (the server and its blocks inherit it)")
    setting.add_argument("--option", help=f"the option of {tool} the turns set, e.g. --option=--warm-cores-ms (with =, as it starts with --)")
    ap.add_argument("--values", required=True, help="its value in each turn, comma-separated, e.g. 0,1,0,1")
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--also", default="", help=f'arguments added to every turn\'s {tool}, e.g. --also="--warm-cores-ms 50"')
    ap.add_argument("--turn-s", type=float, default=turn_s, help="a turn's time limit; one past it is left unfinished")
    return ap


def run_turns(ap: argparse.ArgumentParser, args: argparse.Namespace, tool: str, command: Callable[[Path], list[str]],
              done: Callable[[Path], bool], summary_md: Callable[[str, list[str], list[str]], str], report: str,
              quiet: bool = False) -> None:
    """Each turn not ``done`` yet: ``command(turn_dir)`` plus ``--also``, with the setting set to the turn's
    value (its output dropped if ``quiet``); ``out/report`` (``summary_md(setting, values, also)``)
    rewritten after each turn, then printed."""
    if args.option is not None and not args.option.startswith("--"):
        ap.error(f"--option takes the option as {tool} spells it, e.g. --warm-cores-ms, not {args.option!r}")
    setting, values, also = args.env or args.option, args.values.split(","), shlex.split(args.also)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = Path(report).stem
    for name, value in zip(turn_names(values), values, strict=True):
        if done(args.out / name):  # a run cut short, resumed: say so, as a reused --out would be a surprise
            print(f"[{tag}] {name}: already measured in {args.out / name}, not run again", flush=True)
            continue
        cmd, environ = turn_call([*command(args.out / name), *also], args.env, args.option, value)
        print(f"[{tag}] {name}: {setting}={value} {' '.join(cmd[1:])}", flush=True)
        try:
            # A turn ends with this process (killed, or out of its machine's time): its bench stops its server in turn.
            run_child(cmd, env=environ, timeout=args.turn_s, check=False, stdout=subprocess.DEVNULL if quiet else None)
        except subprocess.TimeoutExpired:
            print(f"[{tag}] {name}: past its {args.turn_s:g} s limit", flush=True)
        (args.out / report).write_text(summary_md(setting, values, also))
    (args.out / report).write_text(summary_md(setting, values, also))
    print((args.out / report).read_text())


def main() -> None:
    ap = setting_parser(__doc__, "`blockflow bench`", turn_s=600)
    ap.add_argument("--row", default="fp16_host", help=f"precision and client input: {', '.join(r.name for r in ROWS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="perf_analyzer's measurement window")
    args = ap.parse_args()
    rows = {r.name: r for r in ROWS}
    if args.row not in rows:
        ap.error(f"unknown row {args.row!r}; rows: {', '.join(rows)}")
    row = rows[args.row]
    run_turns(ap, args, "`blockflow bench`",
              lambda turn: bench_command(row, args.plan, turn, args.repeats, args.seconds, mps=False),
              lambda turn: finished(turn, row) is not None,
              lambda setting, values, also: summary(args.out, setting, values, row, also), "turns.md")


if __name__ == "__main__":
    main()
