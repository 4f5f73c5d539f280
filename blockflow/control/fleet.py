"""One plan on several servers: ``blockflow apply --fleet``, through each server's control service.

The rules, in order:

1. **Nothing changes until every server agrees.** Each is asked for the plan it serves
   (``GET /plan``, which also checks the token) and to check the new one (``POST /plan?dry_run=true``:
   the server's own limits, weights directories and GPUs). If any cannot, no server is changed.
2. **One server at a time**, in the order given; the first is the canary. Each applies the plan
   with its own guarantees (loads before unloads; a failed load restores its previous plan), so
   the others keep serving the previous plan meanwhile.
3. **A soak, when asked for** (``soak_s``): a server that took the plan is watched that long
   (``GET /status`` every second) before the next one is changed. It fails the soak if a task or
   block of the plan stops being ready, if more than ``soak_failures`` requests to its tasks fail
   in the time (Triton's count of requests that ran and failed; a request Triton refuses before
   it runs, a wrong shape, is the client's and not counted), or if its control service stops
   answering. Load is the clients': the soak sends no requests of its own, so a task that no
   request reached during the soak was checked for readiness only; the outcome names such
   tasks (``quiet``) and the log says so.
4. **A failure rolls the fleet back.** The servers already changed get back the plan text they
   served before (from step 1), newest first; those not reached were never changed. The fleet
   ends on the previous plan everywhere, or the report says which server could not get it back.
   A server that failed its soak is given its previous plan back too.
5. **A report per server**: what happened there, the changes, the seconds, the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from blockflow.control.client import ControlClient
from blockflow.core.errors import ApplyError, BlockFlowError

# What happened on one server.
UNCHANGED = "unchanged"  # it already served the plan
APPLIED = "applied"
FAILED = "failed"  # its own apply failed (it restored its previous plan itself)
FAILED_SOAK = "failed soak"  # took the plan, then failed its soak; given its previous plan back
ROLLED_BACK = "rolled back"  # applied, then given its previous plan back after another server failed
ROLLBACK_FAILED = "rollback failed"
NOT_REACHED = "not reached"  # the fleet stopped before this server
CHECKED = "checked"  # a dry run passed


@dataclass
class ServerOutcome:
    url: str
    state: str = NOT_REACHED
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    previous_name: str | None = None
    quiet: list[str] = field(default_factory=list)  # tasks no request reached during the soak


def apply_fleet(text: str, urls: Sequence[str], token: str, dry_run: bool = False, timeout: float = 1800.0,
                log: Callable[[str], None] = lambda _: None, soak_s: float = 0.0, soak_failures: int = 0) -> list[ServerOutcome]:
    """Apply the plan ``text`` to the servers at ``urls`` (control-service URLs) by the rules above.

    Returns one outcome per server, in order; raises nothing for a server's failure (the outcomes
    say it), only :class:`ApplyError` when ``urls`` is empty or repeats a server.
    """
    if not urls:
        raise ApplyError("no servers given for the fleet")
    if len({u.rstrip("/") for u in urls}) != len(urls):
        raise ApplyError("a server is named twice in the fleet")
    servers = [ControlClient(u, token, timeout) for u in urls]
    outcomes = [ServerOutcome(s.url) for s in servers]
    previous: list[str | None] = [None] * len(servers)
    try:
        for i, (s, o) in enumerate(zip(servers, outcomes, strict=True)):  # rule 1
            try:
                now = s.current()
                previous[i], o.previous_name = now.get("text"), now.get("name")
                report = s.post(text, dry_run=True)
            except BlockFlowError as exc:  # unreachable, a bad token, or the plan refused
                o.state, o.error = FAILED, f"refused before any change: {exc}"
                log(f"{s.url}: {o.error}; no server was changed")
                return outcomes
            o.state, o.lines = CHECKED, report["lines"]
        if dry_run:
            return outcomes
        for i, (s, o) in enumerate(zip(servers, outcomes, strict=True)):  # rule 2
            log(f"{s.url}: applying ({i + 1} of {len(servers)})")
            t0 = time.monotonic()
            try:
                # Counts start from before the change: the switch's own failures are the plan's too.
                base = counts(s.status()) if soak_s > 0 else {}
                report = s.post(text)
            except BlockFlowError as exc:
                o.state, o.error, o.seconds = FAILED, str(exc), time.monotonic() - t0
                log(f"{s.url}: failed: {exc}; rolling back the {i} server(s) already changed")
                return _stop_fleet(i, i, servers, outcomes, previous, log)
            o.state = APPLIED if report["steps"] else UNCHANGED
            o.lines, o.seconds = report["lines"], time.monotonic() - t0
            if soak_s > 0 and o.state == APPLIED:  # rule 3
                log(f"{s.url}: soaking for {soak_s:g} s")
                why, o.quiet = soak(s, soak_s, soak_failures, base)
                o.seconds = time.monotonic() - t0
                if why is not None:
                    o.state, o.error = FAILED_SOAK, why
                    log(f"{s.url}: failed its soak: {why}; rolling back the {i + 1} server(s) changed")
                    return _stop_fleet(i, i + 1, servers, outcomes, previous, log)
                if o.quiet:
                    log(f"{s.url}: no request reached task(s) {', '.join(o.quiet)} during the soak: "
                        "only their readiness was checked")
        return outcomes
    finally:
        for s in servers:
            s.close()


def counts(status: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(succeeded, failed) requests per task, from a control service's ``GET /status``."""
    return {task: (int(v.get("succeeded", 0)), int(v.get("failed", 0))) for task, v in status["tasks"].items()}


def _since(now: dict[str, tuple[int, int]], base: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Each task's counts since ``base``; a count below its base means the model was loaded again
    since (its counts start over), so it counts whole."""
    out = {}
    for task, (ok, failed) in now.items():
        ok0, failed0 = base.get(task, (0, 0))
        out[task] = (ok - ok0 if ok >= ok0 else ok, failed - failed0 if failed >= failed0 else failed)
    return out


def soak(server: ControlClient, seconds: float, max_failures: int, base: dict[str, tuple[int, int]],
         every: float = 1.0) -> tuple[str | None, list[str]]:
    """Watch ``server`` for ``seconds`` by rule 3, counting requests from ``base`` (:func:`counts`
    before the change). Returns why it failed (None if it stayed healthy) and the tasks that no
    request reached in the time."""
    deadline = time.monotonic() + seconds
    quiet: list[str] = []
    try:
        while True:
            status = server.status()
            down = [f"task {t}" for t, v in status["tasks"].items() if not v["ready"]]
            down += [f"block {b}" for b, v in status["blocks"].items() if not v["ready"]]
            if down:
                return f"not ready during the soak: {', '.join(down)}", quiet
            since = _since(counts(status), base)
            quiet = sorted(t for t, (ok, failed) in since.items() if ok + failed == 0)
            failed = {t: n for t, (_, n) in since.items()}
            if sum(failed.values()) > max_failures:
                where = ", ".join(f"{t}: {n}" for t, n in sorted(failed.items()) if n)
                return f"{sum(failed.values())} request(s) failed during the soak ({where}); at most {max_failures} allowed", quiet
            left = deadline - time.monotonic()
            if left <= 0:
                return None, quiet
            time.sleep(min(every, left))
    except BlockFlowError as exc:
        return f"its control service did not answer during the soak: {exc}", quiet


def _stop_fleet(failed: int, changed: int, servers: Sequence[ControlClient], outcomes: list[ServerOutcome],
                previous: Sequence[str | None], log: Callable[[str], None]) -> list[ServerOutcome]:
    """Rule 4 after server ``failed``: the first ``changed`` servers go back; those after it were not reached."""
    _roll_back(servers[:changed], outcomes[:changed], previous[:changed], log)
    for later in outcomes[failed + 1:]:
        later.state = NOT_REACHED
    return outcomes


def _roll_back(servers: Sequence[ControlClient], outcomes: Sequence[ServerOutcome], previous: Sequence[str | None],
               log: Callable[[str], None]) -> None:
    for s, o, text in reversed(list(zip(servers, outcomes, previous, strict=True))):
        if o.state == UNCHANGED:
            continue  # it served this plan before: nothing to undo
        # A server that failed its soak keeps that state (and its reason) once it is back.
        why = f"{o.error}; then " if o.state == FAILED_SOAK else ""
        if text is None:
            o.state, o.error = ROLLBACK_FAILED, why + "the server kept no previous plan to go back to"
            continue
        try:
            s.post(text)
            if not why:
                o.state = ROLLED_BACK
            log(f"{s.url}: back on its previous plan {o.previous_name!r}")
        except BlockFlowError as exc:
            o.state, o.error = ROLLBACK_FAILED, f"{why}could not go back to its previous plan: {exc}"
            log(f"{s.url}: could not go back to its previous plan: {exc}")


def succeeded(outcomes: Sequence[ServerOutcome]) -> bool:
    return all(o.state in (APPLIED, UNCHANGED, CHECKED) for o in outcomes)
