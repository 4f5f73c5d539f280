"""The ``apply`` command: a new plan for a running server, or a fleet of them, through its control
service or straight to Triton."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from blockflow.cli import where
from blockflow.cli.app import JSON, PLAN, app, emit, err, out, read_secret
from blockflow.core import env

if TYPE_CHECKING:
    from blockflow.control.client import ControlClient


@app.command()
@PLAN
@click.option("--url", default=None, help="The control service of `blockflow serve` (default: $BLOCKFLOW_CONTROL_URL, else the "
              "running server's endpoints file, else http://127.0.0.1:8003).")
@click.option("--token-file", type=click.Path(path_type=Path), default=None,
              help="File with the bearer token (default: $BLOCKFLOW_TOKEN_FILE, $BLOCKFLOW_TOKEN, else the endpoints file's).")
@click.option("--dry-run", is_flag=True, help="Only print what would change.")
@click.option("--triton-grpc-url", "triton_url", default=None, metavar="HOST:PORT",
              help="Apply straight to the Triton whose gRPC endpoint this is (explicit model control; loads go over gRPC "
                   "so that they never hold up HTTP inference) instead of the control service; needs --repository.")
@click.option("--repository", type=click.Path(path_type=Path), default=None, help="With --triton-grpc-url: the server's BlockFlow model repository.")
@click.option("--admin-key-file", type=click.Path(path_type=Path), default=None,
              help="With --triton-grpc-url: the key of Triton's restricted model-repository API (blockflow serve writes it to "
                   "<runtime dir>/admin.key).")
@click.option("--fleet", default=None, metavar="URL,URL,...",
              help="Apply to these control services one at a time (the first is the canary) instead of --url; if one "
                   "fails, those already changed go back to their previous plan. One token for all.")
@click.option("--fleet-file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="As --fleet, one control-service URL per line (# starts a comment).")
@click.option("--soak", type=click.FloatRange(0, 86400), default=0.0, show_default=True, metavar="SECONDS",
              help="With a fleet: watch each server that took the plan this long before changing the next; if a task or "
                   "block stops being ready or more than --soak-failures requests fail, the fleet goes back.")
@click.option("--soak-failures", type=click.IntRange(0), default=0, show_default=True,
              help="With --soak: failed requests (Triton's count of requests that ran) a server may have in its soak.")
@JSON
def apply(plan: Path, url: str | None, token_file: Path | None, dry_run: bool, triton_url: str | None, repository: Path | None,
          admin_key_file: Path | None, fleet: str | None, fleet_file: Path | None, soak: float, soak_failures: int,
          as_json: bool) -> None:
    """Make a running server, or a fleet of them, serve PLAN, without stopping it.

    New and changed blocks load first, then the ensembles that use them; removed tasks and
    the blocks no task needs any more are unloaded last. If a load fails, the previous plan
    is restored and keeps serving every task. A fleet is checked whole, then changed one
    server at a time, and rolled back whole if one server fails.
    """
    from blockflow.plan import load_plan

    p = load_plan(plan)  # a bad plan is refused here, before anything is sent
    if fleet is None and fleet_file is None and soak:
        raise click.UsageError("--soak watches the servers of a fleet: give --fleet or --fleet-file")
    if fleet is not None or fleet_file is not None:
        if triton_url is not None:
            raise click.UsageError("--fleet goes through the servers' control services, not --triton-grpc-url")
        urls = (fleet or "").split(",")
        if fleet_file is not None:
            urls += [line.split("#", 1)[0] for line in fleet_file.read_text().splitlines()]
        urls = [u.strip() for u in urls if u.strip()]
        _apply_fleet(plan, urls, _token(token_file), dry_run, as_json, soak, soak_failures)
        return
    if triton_url is not None:
        from blockflow.control.apply import Applier

        if repository is None:
            raise click.UsageError("--triton-grpc-url needs --repository (the directory the server loads models from)")
        admin_key = read_secret(admin_key_file, "--admin-key-file") if admin_key_file is not None else ""
        applier = Applier(triton_url, repository, log=lambda m: err.print(m, markup=False, highlight=False), admin_key=admin_key)
        try:
            report = applier.apply(p, dry_run=dry_run)
        finally:
            applier.close()
        lines, steps, seconds = report.diff.lines(), report.steps, report.seconds
        stand_ins = list(report.stand_ins)
    else:
        from blockflow.control.client import ControlClient

        address = where.control(url)
        token = _token(token_file)
        with where.reaching(address), ControlClient(address.value, token) as control:
            if dry_run:
                body = control.post(plan.read_text(), dry_run=True, source=f"{plan} (refused by the server)")
            else:
                body = _post_with_progress(control, ControlClient(address.value, token, timeout=10), plan)
        lines, steps, seconds = body["lines"], body["steps"], body["seconds"]
        stand_ins = list(body.get("stand_ins", []))  # a server of an older BlockFlow leaves it out
    if as_json:
        emit({"plan": p.raw.name, "dry_run": dry_run, "changes": list(lines), "stand_ins": stand_ins, "steps": list(steps),
              "seconds": seconds})
        return
    from blockflow.control.apply import stand_in_note

    for line in [*lines, stand_in_note(stand_ins)]:
        if line:
            out.print(line, markup=False, highlight=False)
    if dry_run:
        out.print("(dry run: nothing changed)")
    elif steps:
        out.print(f"[green]applied[/] {p.raw.name!r} in {seconds:.1f} s")


def _post_with_progress(control: ControlClient, watcher: ControlClient, plan: Path) -> dict[str, Any]:
    """POST the plan while logging each step the server reports done (a load can take minutes)."""
    from concurrent.futures import ThreadPoolExecutor, wait

    from blockflow.core.errors import BlockFlowError

    log = logging.getLogger("blockflow.apply")
    shown = 0
    with ThreadPoolExecutor(1) as pool, watcher:
        posted = pool.submit(control.post, plan.read_text(), False, f"{plan} (refused by the server)")
        while not wait([posted], timeout=0.5).done:
            try:
                progress = watcher.progress()
            except BlockFlowError:
                continue  # progress is a courtesy: the POST's own answer decides
            steps = progress.get("steps", [])
            for step in steps[shown:]:
                shown += 1
                log.info("%s (%d/%d)", step, shown, progress.get("total", 0))
        body = posted.result()
    for step in body.get("steps", [])[shown:]:
        shown += 1
        log.info("%s (%d/%d)", step, shown, len(body.get("steps", [])))
    return dict(body)


def _token(token_file: Path | None) -> str:
    import os

    path = where.token_file(token_file)
    token = read_secret(path, "--token-file") if path is not None else os.environ.get(env.TOKEN, "")
    if not token:
        raise click.UsageError(f"give the control service's token with --token-file, ${env.TOKEN_FILE} or ${env.TOKEN} "
                               "(or run blockflow serve here: its endpoints file names the token's file)")
    return token


def _apply_fleet(plan: Path, urls: list[str], token: str, dry_run: bool, as_json: bool = False, soak: float = 0.0,
                 soak_failures: int = 0) -> None:
    from blockflow.control.fleet import apply_fleet, succeeded
    from blockflow.core.errors import ApplyError

    outcomes = apply_fleet(plan.read_text(), urls, token, dry_run=dry_run,
                           log=lambda m: err.print(m, markup=False, highlight=False), soak_s=soak, soak_failures=soak_failures)
    if as_json:
        emit({"plan": str(plan), "dry_run": dry_run, "applied": succeeded(outcomes) and not dry_run,
              "servers": [{"url": o.url, "state": o.state, "seconds": o.seconds, "changes": list(o.lines), "error": o.error or None,
                           "quiet_tasks": list(o.quiet)}
                          for o in outcomes]})
        if not succeeded(outcomes):
            raise click.exceptions.Exit(ApplyError.exit_code)
        return
    table = Table(title=f"fleet: {plan}")
    for col in ("server", "result", "s", "changes / error"):
        table.add_column(col)
    for o in outcomes:
        table.add_row(o.url, o.state, f"{o.seconds:.1f}", o.error or "; ".join(o.lines) or "-")
    out.print(table)
    if not succeeded(outcomes):
        raise ApplyError("the plan was not applied to the fleet: " + "; ".join(f"{o.url} {o.state}" for o in outcomes if o.state != "not reached"))
    out.print("(dry run: nothing changed)" if dry_run else f"[green]applied[/] to {len(outcomes)} server(s)")
