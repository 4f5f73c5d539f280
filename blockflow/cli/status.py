"""The ``status`` command: tasks and blocks of a running server, once or refreshed until Ctrl-C."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click
from rich.console import Group
from rich.table import Table

from blockflow.cli import where
from blockflow.cli.app import app, emit, out

if TYPE_CHECKING:
    from blockflow.control.status import Snapshot
    from blockflow.triton.api import TritonApi


@app.command()
@click.option("--url", default=None, help="Triton's HTTP endpoint (default: $BLOCKFLOW_HTTP_URL, else the running server's "
              "endpoints file, else 127.0.0.1:8000).")
@click.option("--metrics-url", default=None, help="Triton's metrics (default: $BLOCKFLOW_METRICS_URL, else the endpoints file's "
              "when --url is its server, else port 8002 on the --url host).")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between the two samples rates are computed from.")
@click.option("--watch", is_flag=True, help="Refresh the tables every --interval seconds until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print one sample as JSON instead of tables.")
def status(url: str | None, metrics_url: str | None, interval: float, watch: bool, as_json: bool) -> None:
    """Tasks (ready, request rate, p50/p99) and blocks (instances, device, memory, utilisation, queue and compute time)."""

    import httpx

    from blockflow.control.status import block_rows, snapshot, task_rows
    from blockflow.triton.api import TritonApi

    triton = where.http(url)
    metrics = where.metrics(metrics_url, triton)
    api = TritonApi(http_url=triton.value, timeout=30)
    murl = metrics.value
    with httpx.Client(timeout=30) as client, where.reaching(triton, metrics):
        prev = snapshot(api, murl, client)
        time.sleep(interval)
        cur = snapshot(api, murl, client)
        if as_json:
            emit({"tasks": task_rows(prev, cur), "blocks": block_rows(prev, cur)})
            return
        if not watch:
            out.print(_status_tables(task_rows(prev, cur), block_rows(prev, cur), out.width))
            return
    _watch(api, murl, interval, triton.value, prev, cur)


def _watch(api: TritonApi, murl: str, interval: float, where_to: str, prev: Snapshot | None, cur: Snapshot | None) -> None:
    """Redraw the tables every ``interval`` until Ctrl-C; while the server does not answer (a restart),
    say so and keep asking."""
    import httpx
    from rich.live import Live
    from rich.text import Text

    from blockflow.control.status import block_rows, snapshot, task_rows
    from blockflow.core.errors import Unreachable

    down_since = ""
    with httpx.Client(timeout=min(30.0, 2 * interval + 5)) as client, Live(Group(), console=out, refresh_per_second=4) as live:
        try:
            while True:
                stamp = time.strftime("%H:%M:%S")
                if prev is not None and cur is not None:
                    head = Text(f"{where_to}  {stamp}  every {interval:g} s  (Ctrl-C stops)", style="dim")
                    live.update(Group(head, _status_tables(task_rows(prev, cur), block_rows(prev, cur), out.width)))
                time.sleep(interval)
                try:
                    prev, cur = cur, snapshot(api, murl, client)
                    down_since = ""
                except Unreachable as exc:
                    down_since = down_since or stamp
                    prev = cur = None
                    live.update(Text(f"{where_to} does not answer since {down_since}; waiting for it (Ctrl-C stops)\n{exc}",
                                     style="yellow"))
        except KeyboardInterrupt:
            pass


def _status_tables(tasks: list[dict[str, object]], blocks: list[dict[str, object]], width: int = 200) -> Group:
    """The tasks and blocks tables; below 120 columns, the blocks' columns that matter most, borderless."""
    from rich import box

    def num(v: object, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def ready(v: object) -> str:
        return "[green]ready[/]" if v else "[red]down[/]"

    narrow = width < 120
    style = {"box": box.SIMPLE_HEAD, "pad_edge": False} if narrow else {}
    t = Table(title="tasks", **style)  # type: ignore[arg-type]
    for col in ("task", "state", "req/s", "failed", "mean ms", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col in ("task", "state") else "right", no_wrap=True)
    for r in tasks:
        t.add_row(str(r["task"]), ready(r["ready"]), num(r["rate"], ".1f"), str(r["failed"]), num(r["mean_ms"], ".2f"),
                  num(r["p50_ms"], ".2f"), num(r["p99_ms"], ".2f"))
    if tasks and all(r["p50_ms"] is None for r in tasks):
        t.caption = "p50/p99 come from Triton's latency summaries: `blockflow serve --latency-summaries`, once requests have run"
    b = Table(title="blocks", **style)  # type: ignore[arg-type]
    cols = ("block", "state", "device", "GPU MiB", "req/s", "queue ms", "compute ms") if narrow else \
        ("block", "state", "inst", "device", "GPU MiB", "RSS MiB", "GPU util", "CPU", "req/s", "queue ms", "compute ms")
    for col in cols:
        b.add_column(col, justify="left" if col in ("block", "state", "device") else "right", no_wrap=True)
    for r in blocks:
        cells = {"block": f"{r['block']} (link)" if r.get("link") else str(r["block"]), "state": ready(r["ready"]), "inst": str(r["instances"]), "device": str(r["device"]),
                 "GPU MiB": num(r["gpu_mem_mib"], ".0f"), "RSS MiB": num(r["rss_mib"], ".0f"), "GPU util": num(r["gpu_util"], ".0%"),
                 "CPU": num(r["cpu_util"], ".0%"), "req/s": num(r["rate"], ".1f"), "queue ms": num(r["queue_ms"], ".2f"),
                 "compute ms": num(r["compute_ms"], ".2f")}
        b.add_row(*(cells[c] for c in cols))
    return Group(t, b)
