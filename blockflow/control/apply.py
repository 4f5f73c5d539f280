"""Bring a running Triton in step with a plan, through its model control API.

How an update runs (:meth:`Applier.apply`), and why in this order:

0. Where blocks that keep their names would compute something else (another cut, precision or
   weights) beside another such block on a served ensemble's path, or in an ensemble whose steps
   change (:func:`~blockflow.control.order.stand_ins`), the plan is first applied with those blocks
   under temporary names (``<block>__next``; the monolithic references, in no ensemble, as planned),
   then as written. Triton takes an ensemble request's models when it starts, so a request starting
   while blocks reload in place could run old and new blocks together; under other names the new
   blocks join requests only with the new ensembles. Each of the two applies is the steps below, a
   rename each: those blocks load twice, the references once.
1. Read what the server runs: the READY models of its repository index and, from
   each one's config, the ``blockflow.digest`` the generator stamped on it.
   Models without a digest were not made by BlockFlow and are left alone.
2. Compare with the plan's rendered repository: each model is new, changed
   (another digest), unchanged, or removed (served, not in the plan).
3. Write the new and changed *blocks* into the repository and load them, all
   in parallel (their processes start at once). A changed block is reloaded in
   place: Triton starts the new instances before it retires the old ones, so
   requests keep flowing (TensorMQ producers drain their outstanding tickets
   before they exit).
4. Write and load the new and changed *ensembles* (in parallel). Their blocks
   are loaded by then, so this takes milliseconds, and a task answers as soon
   as its ensemble's load returns. The exception: ensembles some of whose
   blocks stop handing over directly (:func:`hand_over_order`). A plain chain
   of steps runs on blocks that hand over and on blocks that do not (a sender
   answers after its commit, and a receiver reads its sender's own ticket as
   it is), while an ensemble's hand-overs need blocks that make them (a
   receiver that no longer waits for hand-overs would be given the sender's
   input). So an ensemble that only loses hand-overs, and names served blocks
   only, loads *before* step 3; one that also gains some, or names new blocks,
   is first loaded as its old steps without hand-overs, then as planned after
   step 3. An ensemble that only gains hand-overs runs its old steps on the
   new blocks, so the blocks go first, as for any change.
5. Unload removed ensembles first, then the blocks no task uses any more, and
   delete their directories. In-flight requests of a removed task hold their
   own references to its models, so they finish.

If a load in steps 3–4 fails, everything done so far is undone
(:mod:`blockflow.control.undo`): new ensembles are unloaded and deleted (they
may run changed blocks), ensembles whose hand-overs changed run as plain chains
of their old steps while the blocks go back, old files go back, changed models are
reloaded from them, then new blocks are unloaded and deleted. The server then serves the old plan for every task, and
:class:`~blockflow.core.errors.ApplyError` says what failed and what was restored.
Nothing is unloaded before every load succeeded.

Callers that also reload crashed blocks (``blockflow serve``) share ``lock``
with the applier, so a model being swapped is never mistaken for a dead one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from blockflow.control.diff import Change, Diff, Served, as_served, compute_diff, digest_of
from blockflow.control.order import (
    STAND_IN,
    HandOverOrder,
    Widening,
    bridge,
    chain_parts_changed,
    hand_over_order,
    hand_overs_changed,
    stand_ins,
    widening,
    with_planned_references,
    with_stand_ins,
)
from blockflow.control.undo import Undo
from blockflow.core import also_accepts
from blockflow.core.errors import ApplyError, TritonApiError
from blockflow.ensemble_gen import generator, rendered
from blockflow.ensemble_gen.configs import config_changes
from blockflow.ensemble_gen.rendered import RenderedModel, RenderedRepository
from blockflow.plan import Plan
from blockflow.triton.api import TritonApi

_Model = TypeVar("_Model", RenderedModel, RenderedModel | None)  # one model (None: no directory)


@dataclass
class Report:
    """What one :meth:`Applier.apply` did (while it runs, :attr:`Applier.current` is this, filling up)."""

    diff: Diff
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    total: int | None = None  # the steps to make, where not one per change of the diff (step 0)
    stand_ins: tuple[str, ...] = ()  # blocks that load under temporary names first (step 0)

    def progress(self) -> dict[str, Any]:
        """The steps done so far out of the changes to make (``GET /plan/progress``)."""
        total = self.total if self.total is not None else len(self.diff.changes)
        return {"running": True, "done": len(self.steps), "total": total, "steps": list(self.steps),
                "seconds": round(time.monotonic() - self.started, 3)}


class Applier(Undo):
    """Applies plans to the Triton at ``url`` whose (explicit-mode) repository is ``repository``; a failed
    apply is undone by :class:`~blockflow.control.undo.Undo`."""

    def __init__(self, grpc_url: str, repository: Path, lock: threading.Lock | None = None, timeout: float = 900.0,
                 log: Callable[[str], None] | None = None, admin_key: str = "") -> None:
        # Load, unload and the repository index are Triton's restricted APIs (blockflow.triton.access),
        # called over gRPC so that loads never hold up inference (blockflow.triton.api).
        self.control = TritonApi(grpc_url=grpc_url, admin_key=admin_key, timeout=timeout)
        self.repository = repository
        self.lock = lock or threading.Lock()
        self._log = log or (lambda _msg: None)
        self.current: Report | None = None  # the apply in progress, read by other threads for its progress

    @contextmanager
    def _failing_as_apply(self) -> Iterator[None]:
        try:
            yield
        except TritonApiError as exc:
            raise ApplyError(str(exc)) from None

    # ------------------------------------------------------------------ reading the server

    def served(self) -> list[Served]:
        """The server's READY models, with their BlockFlow digests."""
        out = []
        with self._failing_as_apply():
            for m in self.control.index():
                if m.state == "READY":
                    cfg = self.control.config(m.name)
                    out.append(Served(m.name, cfg.get("platform") == "ensemble", digest_of(cfg)))
        return out

    def request_counts(self) -> dict[str, tuple[int, int]]:
        """Each loaded model's (succeeded, failed) inference requests since it loaded, from Triton.

        A request Triton refuses before it runs (a wrong shape, too large a batch) is in neither count.
        """
        with self._failing_as_apply():
            stats = self.control.statistics()
        # Over gRPC a count of zero is left out of the JSON (protobuf's default values are).
        def count(entry: dict[str, Any], kind: str) -> int:
            return int(entry.get("inference_stats", {}).get(kind, {}).get("count", 0))

        return {name: (count(s, "success"), count(s, "fail")) for name, s in stats.items()}

    def diff(self, plan: Plan) -> Diff:
        wanted = rendered.render(plan)
        d = compute_diff(wanted, self.served())
        return self._with_fields(d, wanted, self._models_of(d.changes))

    def _models_of(self, changes: Iterable[Change]) -> dict[str, RenderedModel | None]:
        """Each changed model as the repository holds it (None: no directory there); one whose files do not
        parse is read leniently, so a plan can still replace or remove it."""
        return {c.model: rendered.read_model(self.repository, c.model, lenient=True) for c in changes}

    def _with_fields(self, d: Diff, wanted: RenderedRepository, old: Mapping[str, RenderedModel | None]) -> Diff:
        """``d`` with what changes in each changed model's config, against the repository's ``old`` models."""
        fields = {}
        for c in d.changes:
            before = old[c.model] if c.action == "change" else None
            if before is not None:
                fields[c.model] = tuple(config_changes(before.config, wanted.models[c.model].config))
        return Diff(d.changes, d.unchanged, d.foreign, fields)

    # ------------------------------------------------------------------ changing it

    def _load(self, model: str) -> None:
        with self._failing_as_apply():
            self.control.load(model)

    def _load_all(self, changes: list[Change], report: Report, how: str = "") -> None:
        """Load ``changes`` in parallel; every failure is reported, not only the first."""
        from concurrent.futures import ThreadPoolExecutor

        if not changes:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(changes))) as pool:
            futures = [(c, pool.submit(self._load, c.model)) for c in changes]
            errors = []
            for c, f in futures:
                exc = f.exception()
                if exc is None:
                    report.steps.append(f"loaded {c.model}{how}")
                    self._log(f"loaded {c}{how}")
                else:
                    errors.append(str(exc))
        if errors:
            raise ApplyError("; ".join(errors))

    def _unload(self, model: str) -> None:
        with self._failing_as_apply():
            self.control.unload(model)

    def _load_waves(self, blocks: list[Change], ensembles: list[Change], wanted: Mapping[str, RenderedModel],
                    done: list[Change], report: Report, order: HandOverOrder | None = None,
                    old: Mapping[str, RenderedModel | None] | None = None) -> None:
        """Parallel waves: ensembles that stop handing over (``order``, module docstring step 4), every
        new and changed block, then every other new and changed ensemble and the bridged ones as planned.

        Blocks load on their own, all at once (their processes start in parallel). Reloading a
        block makes Triton reload the loaded ensembles that name it from their files on disk, so
        ensembles' new files are written only after the block wave, just before their own loads
        (a bridged ensemble's files meanwhile hold its bridge, which runs on old and new blocks).
        An ensemble whose blocks are all loaded loads in milliseconds: Triton does not reload a
        block that was loaded on its own just before (measured on 2.51, with block processes
        writing no ``__pycache__`` into the repository).
        """
        order = order or HandOverOrder()
        self._wave(list(order.first), wanted, done, report)
        if order.bridged:
            assert old is not None, "bridged ensembles need their old versions"
            bridges = {c.model: bridge(_present(old[c.model])) for c in order.bridged}
            self._wave(list(order.bridged), bridges, done, report, how=" without hand-overs")
        self._wave(blocks, wanted, done, report)
        self._wave([c for c in ensembles if c not in order.first], wanted, done, report)

    def _wave(self, changes: list[Change], models: Mapping[str, RenderedModel], done: list[Change],
              report: Report, how: str = "") -> None:
        """Write ``changes``' ``models`` (noted in ``done`` for an undo), then load them in parallel."""
        if not changes:
            return
        for c in changes:
            if c not in done:
                done.append(c)
            generator.write_model(self.repository, c.model, models[c.model].files)
        self._load_all(changes, report, how)

    def apply(self, plan: Plan, dry_run: bool = False) -> Report:
        """Make the server run ``plan`` (see the module docstring for the order and the guarantees)."""
        t0 = time.monotonic()
        wanted = rendered.render(plan)
        with self.lock:
            if not (self.repository / generator.MARKER).is_file():
                raise ApplyError(f"{self.repository} is not a BlockFlow model repository (no {generator.MARKER}); "
                                 "give the --repository the server was started with")
            served = self.served()
            changes = compute_diff(wanted, served)
            old = self._models_of(changes.changes)
            d = self._with_fields(changes, wanted, old)
            ensembles = {s.name: rendered.read_model(self.repository, s.name, lenient=True) for s in served if s.ensemble}
            first = stand_ins(d.changes, ensembles, old, wanted.models)
            chained = chain_parts_changed([c for c in d.changes if not c.ensemble], old, wanted.models)
            if chained:
                raise ApplyError(f"{', '.join(chained)}: their part in a chain (hand_over: chain) changes, which a running "
                                 "server cannot switch; nothing was changed (stop the server and serve the new plan)")
            report = Report(d, stand_ins=first)
            if dry_run or d.empty:
                report.seconds = time.monotonic() - t0
                return report
            self.current = report
            try:
                if not first:
                    self._change(wanted, served, report, backup=old)
                else:  # step 0
                    names = _stand_in_names(first)
                    self._log(f"loading {names} first: they change what they compute, beside each other on a path")
                    stone = with_planned_references(rendered.render(with_stand_ins(plan, first)), wanted, plan)
                    report.total = len(compute_diff(stone, served).changes) + len(compute_diff(wanted, as_served(stone)).changes)
                    self._change(stone, served, report)
                    self._change(wanted, self.served(), report,
                                 previous=f"the new plan, with {names} (apply the plan again to finish)")
            finally:
                self.current = None
        report.seconds = time.monotonic() - t0
        return report

    def _change(self, repository: RenderedRepository, served: list[Served], report: Report,
                previous: str = "the previous plan", backup: Mapping[str, RenderedModel | None] | None = None) -> None:
        """Steps 3–5 for the rendered ``repository`` against ``served``; undone if a load fails, the
        server then serves ``previous``. ``backup``: the changed models as the repository holds them, if already read."""
        wanted = repository.models
        d = compute_diff(repository, served)
        if backup is None:
            backup = self._models_of(d.changes)
        blocks = [c for c in d.changes if not c.ensemble and c.action != "remove"]
        ensembles = [c for c in d.changes if c.ensemble and c.action != "remove"]
        done: list[Change] = []
        order = hand_over_order(ensembles, backup, wanted, served)
        wider = widening(blocks, backup, wanted)
        try:
            self._load_waves(blocks, ensembles, self._widened(wanted, wider.new), done, report, order, backup)
        except Exception as exc:
            restored = self._undo(done, self._widened(backup, wider.old), hand_overs_changed(ensembles, backup, wanted))
            self._close_widening(wider.old, wider, {c.model for c in done})
            raise ApplyError(f"{exc}\nrolled back ({'; '.join(restored) or 'nothing to undo'}); "
                             f"the server serves {previous}") from None
        self._close_widening(wider.new, wider, {c.model for c in done})
        for c in d.changes:
            if c.action == "remove":  # ensembles come first in the sorted changes
                self._unload(c.model)
                generator.write_model(self.repository, c.model, None)
                report.steps.append(f"unloaded {c.model}")
                self._log(f"unloaded {c}")
        generator.write_marker(self.repository, {generator.MARKER: repository.marker})

    def _widened(self, models: Mapping[str, _Model], feeders: Mapping[str, also_accepts.AlsoAccepts]) -> dict[str, _Model]:
        """``models`` with each block of ``feeders`` also accepting those feeders' tickets until the change
        is over (:mod:`blockflow.core.also_accepts`; loads take at most ``timeout`` each, in four waves)."""
        until = time.time() + 4 * self.control.timeout
        out = dict(models)
        for m, f in feeders.items():
            old = out.get(m)
            if old is not None:
                also = f.model_copy(update={"until": until})
                out[m] = old.with_file(also_accepts.FILE, also.dumps())
        return out

    def _close_widening(self, feeders: Mapping[str, also_accepts.AlsoAccepts], wider: Widening, written: set[str]) -> None:
        """The change is over: the blocks of ``feeders`` keep accepting them for their lease, no longer."""
        for m in sorted(feeders.keys() & written):
            f, until = feeders[m], time.time() + wider.lease_s[m]
            try:
                also_accepts.write(self.repository / m, f.model_copy(update={"until": until}))
            except OSError as exc:  # the block then accepts them until the bound _widened set
                self._log(f"could not shorten what {m} also accepts: {exc}")

    def close(self) -> None:
        """Nothing to release (clients live for one call); kept for callers that close appliers."""


def _present(model: RenderedModel | None) -> RenderedModel:
    assert model is not None, "a bridged ensemble has its old version"
    return model


def _stand_in_names(blocks: Sequence[str]) -> str:
    return ", ".join(f"{b} as {b}{STAND_IN}" for b in blocks)


def stand_in_note(blocks: Sequence[str]) -> str:
    """What step 0 does first, for people (empty when nothing)."""
    return (f"first, under other names until the plan's ensembles use them: {_stand_in_names(blocks)} "
            "(blocks that change what they compute, beside each other on a path)") if blocks else ""


def instances_by_device(repository: RenderedRepository, gpus: int) -> dict[str, Counter[int | None]]:
    """Stub processes of each Python-backend model of a rendered repository, by GPU index (``None``: the CPU)."""
    from tritonclient.grpc import model_config_pb2 as mc

    out = {}
    for name, model in repository.models.items():
        cfg = model.config
        if cfg.backend != "python":
            continue
        devices: Counter[int | None] = Counter()
        for g in cfg.instance_group:
            if g.kind == mc.ModelInstanceGroup.KIND_CPU or (g.kind == mc.ModelInstanceGroup.KIND_AUTO and gpus == 0):
                devices[None] += g.count
            else:  # one set of instances per listed GPU, or per visible GPU when none are listed
                for gpu in g.gpus or range(gpus):
                    devices[gpu] += g.count
        out[name] = devices
    return out


def expected_instances(repository: RenderedRepository, gpus: int) -> dict[str, int]:
    """Stub processes each Python-backend model of a rendered repository should have."""
    return {name: sum(devices.values()) for name, devices in instances_by_device(repository, gpus).items()}
