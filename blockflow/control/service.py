"""The control service: a small REST API through which an optimizer changes what runs.

It lives inside ``blockflow serve`` (the process that owns the model repository and
reloads crashed blocks), binds to localhost by default and wants a bearer token on
every request. Endpoints:

``POST /plan``            body: a plan (YAML or JSON). Validates it, then applies it
                          (``?dry_run=true``: only the difference). 422 for a bad plan,
                          409 when applying failed (and was rolled back).
``GET /plan``             the plan being served, and the history kept on disk.
``POST /plan/rollback``   apply the plan before the current one (``?steps=N`` goes further back).
``GET /status``           tasks and blocks with their readiness on the server.
``GET /metrics``          serve's own metrics, Prometheus' text format (blockflow.control.metrics).
``GET /health/ready``     for probes, the one endpoint without a token: 200 while Triton says it is
                          ready, else 503; it tells nothing more. It answers once both the server
                          and this service are up (a probe of Triton alone passes before this
                          service listens).

Plans are kept as numbered files in ``state_dir`` (the last ``keep``), beside ``started-from``: the digest of
the plan file ``serve`` was started with. A ``serve`` started again with the same plan file and the same
``state_dir`` (a persistent volume) serves the newest plan of the history, applied live before it stopped
(:func:`resumable`); started with another plan file, it serves that one (the operator changed it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from blockflow.control.apply import Applier, Report, expected_instances
from blockflow.control.metrics import ServeMetrics
from blockflow.core.errors import ApplyError, BlockFlowError, PlanError, PlanIssue
from blockflow.ensemble_gen import rendered
from blockflow.plan import Plan, crossing, naming, parse_plan_text
from blockflow.triton.access import same_secret


@dataclass(frozen=True)
class Entry:
    number: int
    path: Path
    name: str
    applied_at: float


@dataclass(frozen=True)
class Limits:
    """What a posted plan may be: a client's plan is untrusted input."""

    max_plan_bytes: int = 1 << 20
    max_tasks: int = 256
    max_blocks: int = 512
    # How long a plan change waits for the one in progress before it is refused (409).
    busy_wait_s: float = 60.0


STARTED_FROM = "started-from"  # in state_dir: the sha256 of the plan file serve was started with


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def history_in(state_dir: Path) -> list[Entry]:
    """The plans kept in ``state_dir``, oldest first."""
    out = []
    for path in sorted(state_dir.glob("plan-*.yaml")):
        number = int(path.stem.split("-")[1])
        text = path.read_text()
        name = text.split("\n", 1)[0].removeprefix("# ").strip()
        out.append(Entry(number, path, name, path.stat().st_mtime))
    return out


def entry_text(entry: Entry) -> str:
    """The plan's text as posted (the file's first line is its name)."""
    return entry.path.read_text().split("\n", 1)[1]


def resumable(state_dir: Path, plan_text: str) -> Entry | None:
    """The newest plan of ``state_dir``'s history, if a ``serve`` started with ``plan_text`` applied it there and
    it differs from ``plan_text``: what a restarted ``serve`` on a persistent state directory serves again."""
    try:
        started_from = (state_dir / STARTED_FROM).read_text().strip()
    except OSError:
        return None
    entries = history_in(state_dir)
    if started_from != _digest(plan_text) or not entries or entry_text(entries[-1]) == plan_text:
        return None
    return entries[-1]


class Controller:
    """Plan history plus the applier; one plan change at a time."""

    def __init__(self, applier: Applier, state_dir: Path, base_dir: Path, gpus: int = 0, keep: int = 10,
                 weights_dirs: Sequence[Path] | None = None, limits: Limits = Limits(),
                 metrics: ServeMetrics | None = None, server: str | None = None) -> None:
        self.applier = applier
        self.server = server  # which of a plan's servers this one is (blockflow.plan.crossing)
        self.metrics = metrics or ServeMetrics()
        self.state_dir = state_dir
        self.base_dir = base_dir  # relative weights files in posted plans are resolved from here
        # Posted plans may name weights files only under these directories (default: the plan's own).
        self.weights_dirs = list(weights_dirs) if weights_dirs else [base_dir]
        self.limits = limits
        self.gpus = gpus
        self.keep = keep
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.plan: Plan | None = None
        self.expected: dict[str, int] = {}  # stub processes per block model, for healing
        # Whether the history outlives this serve (--state-dir), and the plan it resumed from it, if it did.
        self.kept = False
        self.resumed_from: int | None = None
        self._serial = threading.Lock()

    # ------------------------------------------------------------------ history

    def history(self) -> list[Entry]:
        return history_in(self.state_dir)

    def _record(self, text: str, plan: Plan) -> None:
        entries = self.history()
        number = entries[-1].number + 1 if entries else 1
        path = self.state_dir / f"plan-{number:06d}.yaml"
        path.write_text(f"# {plan.raw.name}\n{text}")
        for old in entries[: max(0, len(entries) + 1 - self.keep)]:
            old.path.unlink(missing_ok=True)

    def parse(self, text: str, source: str) -> Plan:
        lim = self.limits
        if len(text.encode()) > lim.max_plan_bytes:
            raise PlanError([PlanIssue("", f"the plan is larger than {lim.max_plan_bytes} bytes")], source)
        plan = parse_plan_text(text, source=source, base_dir=self.base_dir, weights_dirs=self.weights_dirs).on_server(self.server)
        too_many = [PlanIssue(key, f"{n} {key} are more than this server accepts ({most})")
                    for key, n, most in (("tasks", len(plan.raw.tasks), lim.max_tasks), ("blocks", len(plan.raw.blocks), lim.max_blocks))
                    if n > most]
        if too_many:
            raise PlanError(too_many, source)
        issues = plan.device_issues(self.gpus)
        if issues:
            raise PlanError(issues, source)
        return plan

    def adopt(self, text: str, plan: Plan, started_from: str | None = None) -> None:
        """Record ``plan`` as the one the server already runs (after ``blockflow serve`` started it), started from
        the plan file ``started_from`` (default: ``text``; another when ``serve`` resumed the history's newest)."""
        self.plan = plan
        self.expected = expected_instances(rendered.render(plan), self.gpus)
        entries = self.history()
        if not entries or entry_text(entries[-1]) != text:
            self._record(text, plan)
        (self.state_dir / STARTED_FROM).write_text(_digest(started_from if started_from is not None else text) + "\n")
        self.metrics.serving(plan.raw.name, text)

    # ------------------------------------------------------------------ changes

    def submit(self, text: str, dry_run: bool = False, source: str = "POST /plan", rollback: bool = False) -> Report:
        plan = self.parse(text, source)
        if not self._serial.acquire(timeout=self.limits.busy_wait_s):
            raise ApplyError(f"another plan change is still in progress after {self.limits.busy_wait_s:g} s; "
                             "nothing was changed, try again later")
        counter = self.metrics.rollbacks if rollback else self.metrics.applies
        try:
            try:
                report = self.applier.apply(plan, dry_run=dry_run)
            except ApplyError:
                counter.labels("failed").inc()
                raise
            if not dry_run:
                counter.labels("ok").inc()
                self.plan = plan
                self.expected = expected_instances(rendered.render(plan), self.gpus)
                if not report.diff.empty or not self.history():
                    self._record(text, plan)
                self.metrics.serving(plan.raw.name, text)
        finally:
            self._serial.release()
        return report

    def rollback(self, steps: int = 1) -> Report:
        entries = self.history()
        if steps < 1 or steps >= len(entries):
            raise ApplyError(f"cannot roll back {steps} plan(s): {len(entries)} plan(s) kept, so at most "
                             f"{max(0, len(entries) - 1)} step(s) back")
        text = entry_text(entries[-1 - steps])
        return self.submit(text, source=f"rollback to plan #{entries[-1 - steps].number}", rollback=True)

    # ------------------------------------------------------------------ reading

    def ready(self) -> bool:
        """Whether Triton answers and says it is ready (its strict readiness: every loaded model is)."""
        return self.applier.control.ready()

    def status(self) -> dict[str, Any]:
        served = {s.name for s in self.applier.served()}
        plan = self.plan
        out: dict[str, Any] = {"plan": plan.raw.name if plan else None, "server": self.server, "tasks": {}, "blocks": {},
                               "history": {"dir": str(self.state_dir), "kept_across_restarts": self.kept,
                                           "resumed_from": self.resumed_from}}
        if plan is None:
            return out
        counts = self.applier.request_counts()
        for t in plan.tasks.values():
            # Of a plan across servers, the runs of the task's path this server serves (none: not listed).
            here = [i for i, (server, _) in enumerate(crossing.runs(plan, t)) if server == (plan.server or "")]
            if not here:
                continue
            models = [naming.task_model(t.name, tr, t.transport) if i == 0 else
                      naming.run_ensemble(naming.task_model(t.name, tr, t.transport), i)
                      for tr in plan.transports_of(t) for i in here]
            ok, failed = (sum(counts.get(m, (0, 0))[k] for m in models) for k in (0, 1))
            out["tasks"][t.name] = {"ready": all(m in served for m in models), "ensembles": models, "path": t.path,
                                    "succeeded": ok, "failed": failed}
        for name, instances in sorted(self.expected.items()):  # every Python-backend model of the plan
            out["blocks"][name] = {"ready": name in served, "instances": instances}
        return out


def create_app(controller: Controller, token: str) -> FastAPI:
    """The FastAPI application of the control service."""
    app = FastAPI(title="BlockFlow control", version="1", docs_url=None, redoc_url=None)
    bearer = HTTPBearer(auto_error=False)

    def authorized(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if cred is None or not same_secret(cred.credentials, token):
            raise HTTPException(401, "missing or wrong token: send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(PlanError)
    async def _plan_error(_: Request, exc: PlanError) -> JSONResponse:
        return JSONResponse({"error": str(exc), "issues": [{"loc": i.loc, "message": i.message} for i in exc.issues]},
                            status_code=422)

    @app.exception_handler(ApplyError)
    async def _apply_error(_: Request, exc: ApplyError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=409)

    @app.exception_handler(BlockFlowError)
    async def _other_error(_: Request, exc: BlockFlowError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=500)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug: the traceback goes to serve's log only
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); the serve log has the details"},
                            status_code=500)

    def _report(r: Report) -> dict[str, Any]:
        return {"diff": r.diff.as_dict(), "lines": r.diff.lines(), "stand_ins": list(r.stand_ins), "steps": r.steps, "seconds": round(r.seconds, 3)}

    @app.post("/plan", dependencies=[Depends(authorized)])
    async def post_plan(request: Request, dry_run: bool = False) -> dict[str, Any]:
        body = await _bounded_body(request, controller.limits.max_plan_bytes)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise HTTPException(400, "the plan must be UTF-8 YAML or JSON") from None
        if not text.strip():
            raise HTTPException(400, "empty body: send the plan (YAML or JSON) as the request body")
        return _report(await run_in_threadpool(controller.submit, text, dry_run))

    @app.get("/plan/progress", dependencies=[Depends(authorized)])
    def get_progress() -> dict[str, Any]:
        """The plan change in progress: steps done out of the changes to make; ``running: false`` when none."""
        current = controller.applier.current
        return current.progress() if current is not None else {"running": False}

    @app.get("/plan", dependencies=[Depends(authorized)])
    def get_plan() -> dict[str, Any]:
        entries = controller.history()
        current = entries[-1] if entries else None
        return {
            "name": controller.plan.raw.name if controller.plan else None,
            "text": entry_text(current) if current else None,
            "history": [{"number": e.number, "name": e.name, "applied_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(e.applied_at))}
                        for e in entries],
        }

    @app.post("/plan/rollback", dependencies=[Depends(authorized)])
    async def rollback(steps: int = 1) -> dict[str, Any]:
        return _report(await run_in_threadpool(controller.rollback, steps))

    @app.get("/status", dependencies=[Depends(authorized)])
    async def status() -> dict[str, Any]:
        return await run_in_threadpool(controller.status)

    @app.get("/metrics", dependencies=[Depends(authorized)])
    def metrics() -> Response:
        return Response(controller.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health/ready")
    def health_ready() -> JSONResponse:  # no token: Kubernetes probes cannot send one; it tells only ready or not
        ok = controller.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    return app


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (never read whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the plan is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"the plan is larger than {limit} bytes")
    return bytes(body)


class ControlServer:
    """Runs the control app with uvicorn on a background thread."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        self.host, self.port = host, port
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, name="blockflow-control", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise BlockFlowError(f"the control service could not start on {self.url}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)
