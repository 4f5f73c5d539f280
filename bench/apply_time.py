"""How long one live plan change takes: plan A, then B, A, B, ... applied to one real server.

Serves ``--plan-a`` (explicit model control), then applies the two plans in turns through
:class:`blockflow.control.apply.Applier`, optionally while closed-loop clients keep every task busy, and
writes each change's seconds (and the per-model load log) to ``OUT/apply_time.json``.

    python -m blockflow.bench.apply_time --out DIR [--changes 6] [--clients 2] \\
        [--plan-a tests/plans/live_a.yaml --plan-b tests/plans/live_b.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from blockflow.bench.harness import task_images
from blockflow.clients.client import TaskClient
from blockflow.control.apply import Applier
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer


def _clients(url: str, tasks: list[str], images: dict[str, Any], per_task: int, stop: threading.Event,
             counts: dict[str, list[int]]) -> list[threading.Thread]:
    def loop(task: str) -> None:
        x = images[task]
        with TaskClient(url) as c:
            while not stop.is_set():
                try:
                    c.infer_outputs(task, x)
                    counts[task][0] += 1
                except Exception:
                    counts[task][1] += 1
                    time.sleep(0.05)

    threads = [threading.Thread(target=loop, args=(t,), daemon=True) for t in tasks for _ in range(per_task)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan-a", default="tests/plans/live_a.yaml")
    ap.add_argument("--plan-b", default="tests/plans/live_b.yaml")
    ap.add_argument("--changes", type=int, default=6)
    ap.add_argument("--clients", type=int, default=0, help="closed-loop clients per task during the changes")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    plans = [load_plan(args.plan_a), load_plan(args.plan_b)]
    args.out.mkdir(parents=True, exist_ok=True)
    repo = Path(tempfile.mkdtemp(prefix="apply-time-")) / "repository"
    generator.write(generator.render(plans[0]), repo)
    opts = ServerOptions.on_free_ports([repo])
    rows: list[dict[str, Any]] = []
    counts: dict[str, list[int]] = {t: [0, 0] for p in plans for t in p.tasks}
    with TritonServer(opts) as server:
        t0 = time.monotonic()
        events: list[tuple[float, str]] = []
        applier = Applier(server.grpc_url, repo, admin_key=server.admin_key,
                          log=lambda m: events.append((round(time.monotonic() - t0, 3), m)))
        stop = threading.Event()
        shared = sorted(set(plans[0].tasks) & set(plans[1].tasks))
        images = {t: task_images(plans[0], t, 1) for t in shared}
        threads = _clients(server.http_url, shared, images, args.clients, stop, counts) if args.clients else []
        time.sleep(2 if threads else 0)
        for i in range(args.changes):
            plan = plans[(i + 1) % 2]
            events.clear()
            t0 = time.monotonic()
            report = applier.apply(plan)
            rows.append({"to": plan.raw.name, "seconds": round(report.seconds, 3), "changes": report.diff.lines(),
                         "log": list(events)})
            print(f"[apply-time] {plan.raw.name}: {report.seconds:.2f} s", flush=True)
        stop.set()
        for t in threads:
            t.join(30)
        applier.close()
        # Each block's ready line says where its start-up went (process and imports, build, warm-up).
        startup = [line.split("blockflow: ", 1)[1] for line in server.log_path.read_text(errors="replace").splitlines()
                   if "start-up s:" in line]
    seconds = [r["seconds"] for r in rows]
    summary = {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
               "clients_per_task": args.clients, "requests_ok_failed": {t: c for t, c in counts.items() if any(c)}}
    (args.out / "apply_time.json").write_text(json.dumps({"summary": summary, "changes": rows, "block_startup": startup}, indent=1))
    print(f"[apply-time] {json.dumps(summary)}")


if __name__ == "__main__":
    main()
