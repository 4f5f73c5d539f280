"""What crossing servers costs: a task whose path crosses from one server to the next
(``blockflow.plan.crossing``) against the same task, same blocks and transport, in one server.

    python -m blockflow.bench.crossing --plan plans/bench_cross.yaml --task classify --out DIR

Both servers of the plan run on this machine (each on the GPUs its blocks name); the plan's
``grpc`` addresses are replaced by the ports they are given. The one-server variant is the plan
without ``servers``. Each figure is the median of ``--repeats`` perf_analyzer runs ± half their
range, batch 1: p50 at concurrency 1 and throughput at each ``--concurrency``; the hop's cost is
crossing − one server. ``DIR/results.json`` and ``DIR/report.md``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from blockflow.bench.failures import failed_points, failure_cell
from blockflow.bench.harness import commit, device_name, write_results
from blockflow.bench.perf_analyzer import median_of, perf_analyzer
from blockflow.bench.report import spread_text
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan, load_plan, parse_plan
from blockflow.triton.options import ServerOptions
from blockflow.triton.server import TritonServer


@contextlib.contextmanager
def _servers(plan: Plan, where: Path) -> Iterator[str]:
    """Every server of ``plan`` (later ones first) on this machine; yields the first server's HTTP URL."""
    names = list(plan.raw.servers)
    options = {n: ServerOptions.on_free_ports([where / n]) for n in names}
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    for n, o in options.items():
        raw["servers"][n]["grpc"] = f"127.0.0.1:{o.grpc_port}"
    placed = parse_plan(raw, source=plan.source, base_dir=plan.base_dir)
    servers = []
    try:
        for n in reversed(names):
            generator.write(generator.render(placed.on_server(n)), where / n)
            servers.append(TritonServer(options[n]))
            servers[-1].start(900)
        yield servers[-1].http_url
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def _one_server(plan: Plan, where: Path) -> Iterator[str]:
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    raw.pop("servers")
    for b in raw["blocks"].values():
        b.pop("server", None)
    single = parse_plan(raw, source=f"{plan.source} on one server", base_dir=plan.base_dir)
    generator.write(generator.render(single), where / "one")
    server = TritonServer(ServerOptions.on_free_ports([where / "one"]))
    server.start(900)
    try:
        yield server.http_url
    finally:
        server.stop()


def _measure(url: str, task: str, shape: str, concurrencies: list[int], repeats: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in concurrencies:
        out[str(c)] = median_of([perf_analyzer(url, task, shape, 1, seconds, concurrency=c) for _ in range(repeats)])
    return out


def run(plan_path: Path, task: str, out: Path, concurrencies: list[int], repeats: int, seconds: float) -> dict[str, Any]:
    plan = load_plan(plan_path)
    if not plan.raw.servers:
        raise SystemExit(f"{plan_path} names no servers: nothing crosses")
    model = plan.models[plan.blocks[plan.tasks[task].path[0]].model]
    shape = "IMAGE:" + ",".join(str(d) for d in model.image_shape)
    work = out / "work"
    results: dict[str, Any] = {"meta": {"plan": str(plan_path), "task": task, "commit": commit(), "device": device_name(),
                                        "repeats": repeats, "seconds": seconds}}
    with _servers(plan, work) as url:
        results["crossing"] = _measure(url, task, shape, concurrencies, repeats, seconds)
    with _one_server(plan, work) as url:
        results["one_server"] = _measure(url, task, shape, concurrencies, repeats, seconds)
    return write_results(out, results, report)


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [f"# Crossing servers: task `{meta['task']}` of `{meta['plan']}`", "",
             f"{meta['device']}, commit {meta['commit']}; batch 1, median of {meta['repeats']} perf_analyzer run(s) "
             f"of {meta['seconds']:g} s ± half their range.", "",
             "| concurrency | one server p50 | crossing p50 | crossing cost | one server /s | crossing /s | ratio |",
             "|---|---|---|---|---|---|---|"]
    for c, one in res["one_server"].items():
        cross = res["crossing"][c]
        if "error" in one or "error" in cross:
            lines.append(f"| {c} | {failure_cell(one) if 'error' in one else ''} | {failure_cell(cross) if 'error' in cross else ''} | | | | |")
            continue
        lines.append(f"| {c} | {one['p50_ms']:.2f} ms{spread_text(one, 'p50_ms')} | {cross['p50_ms']:.2f} ms"
                     f"{spread_text(cross, 'p50_ms')} | {cross['p50_ms'] - one['p50_ms']:+.2f} ms | {one['throughput']:.0f}"
                     f"{spread_text(one, 'throughput')} | {cross['throughput']:.0f}{spread_text(cross, 'throughput')} | "
                     f"{cross['throughput'] / one['throughput']:.2f}× |")
    lines += ["", *failed_points([(f"{where} c{c}", res[where][c]) for c in res["one_server"] for where in ("one_server", "crossing")])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--task", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", default="1,32", help="comma-separated (default 1,32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    run(a.plan, a.task, a.out, [int(c) for c in a.concurrency.split(",")], a.repeats, a.seconds)
    print((a.out / "report.md").read_text())


if __name__ == "__main__":
    main()
