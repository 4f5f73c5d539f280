"""Undo a failed apply: put back what its loads changed, so the server serves the plan it served before
(:mod:`blockflow.control.apply`, module docstring: "If a load in steps 3–4 fails")."""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from blockflow.control.diff import Change
from blockflow.control.order import bridge
from blockflow.core.errors import ApplyError
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.rendered import RenderedModel
from blockflow.triton.api import TritonApi


class Undo:
    """The undo of :class:`~blockflow.control.apply.Applier`, which gives it its server and repository,
    and its loads and unloads."""

    control: TritonApi
    repository: Path
    if TYPE_CHECKING:
        def _load(self, model: str) -> None: ...
        def _unload(self, model: str) -> None: ...
        def _failing_as_apply(self) -> AbstractContextManager[None]: ...

    # How long an undo waits, at least, for a new model's load that outlived its wait to end, and then for
    # its unload; a load timeout's worth where that is longer.
    undo_wait_s = 120.0

    def _undo(self, done: list[Change], backup: Mapping[str, RenderedModel | None],
              handed: frozenset[str] = frozenset()) -> list[str]:
        """Put back what a failed apply changed: the new ensembles first, unloaded and deleted once their
        loads have ended (:meth:`_retire_new`), as they may run the changed blocks; the changed ensembles
        of ``handed`` (whose direct hand-overs the apply changed) as plain chains of their old steps; then
        changed models' old files, reloaded blocks before ensembles; then the new blocks, retired alike."""
        new = [c for c in done if c.action == "add"]
        # A new task's ensemble that is READY would otherwise pass its requests to a changed block already
        # back to its old interface, and fail them, for as long as the reloads take.
        notes = self._retire_new([c for c in new if c.ensemble], backup)
        # An ensemble whose hand-overs changed may already run as planned, on blocks that make (or wait
        # for) hand-overs their old versions do not; a plain chain of its old steps runs on both versions
        # (the apply's own order, step 4), and its files hold that chain while the blocks reload, as
        # Triton reloads a block's loaded ensembles from their files. Only where a changed block goes back.
        reloading = any(not c.ensemble and c.action == "change" for c in done)
        chains = {c.model: before for c in done if reloading and c.ensemble and c.action == "change" and c.model in handed
                  and (before := backup.get(c.model)) is not None}
        plain: set[str] = set()
        for model, before in chains.items():
            try:
                generator.write_model(self.repository, model, bridge(before).files)
                self._load(model)
                plain.add(model)
                notes.append(f"loaded {model} as its previous steps without hand-overs")
            except (ApplyError, ValueError) as exc:  # then its previous files, as for any other change
                notes.append(f"could not load {model} without hand-overs: {exc}")
        for c in done:
            if c.action != "add" and c.model not in plain:
                self._write_previous(c, backup)
        for c in sorted((c for c in done if c.action == "change"), key=lambda c: c.ensemble):
            if c.model in plain:  # its blocks are back: now its own previous version
                self._write_previous(c, backup)
            try:
                self._load(c.model)
                notes.append(f"reloaded the previous {c.model}")
            except ApplyError as exc:
                notes.append(f"could not reload the previous {c.model}: {exc}")
        return notes + self._retire_new([c for c in new if not c.ensemble], backup)

    def _write_previous(self, c: Change, backup: Mapping[str, RenderedModel | None]) -> None:
        before = backup.get(c.model)
        generator.write_model(self.repository, c.model, before.files if before is not None else None)

    def _retire_new(self, new: list[Change], backup: Mapping[str, RenderedModel | None]) -> list[str]:
        """Unload the ``new`` models of a failed apply, ensembles first, then delete their directories.

        A load the applier stopped waiting for (the load timeout) still runs in Triton, which makes the
        model READY when it ends. The repository index shows such a model LOADING only while its directory
        exists (Triton lists the directories), and an unload sent meanwhile waits inside Triton for the
        load (one sent after the directory went crashed tritonserver 2.51). So the directories stay until
        no new model loads any more and the READY ones are unloaded.
        """
        if not new:
            return []
        wait_s = max(self.control.timeout, self.undo_wait_s)  # a load: as long as one may take
        unload_s = self.undo_wait_s  # an unload: bounded, while the apply lock (and serve's reloads) wait
        notes, kept = [], set()
        try:
            states = self._settled({c.model for c in new}, {"LOADING"}, wait_s)
            for c in new:
                if "LOADING" in states.get(c.model, ()):
                    kept.add(c.model)
                    notes.append(f"new {c.model} was still loading {wait_s:.0f} s later: left in place (ready once its "
                                 "load ends; an apply after that unloads it if its plan has no such model)")
            for ensembles in (True, False):
                group = {c.model for c in new if c.ensemble == ensembles and c.model not in kept
                         and "READY" in states.get(c.model, ())}
                for m in sorted(group):
                    try:
                        self._unload(m)
                        notes.append(f"unloaded new {m}")
                    except ApplyError as exc:
                        notes.append(f"could not unload new {m}: {exc}")
                        kept.add(m)
                if not group - kept:
                    continue
                states = self._settled(group - kept, {"READY", "UNLOADING"}, unload_s)
                for m in sorted(group - kept):
                    if states.get(m, set()) & {"READY", "UNLOADING"}:
                        kept.add(m)
                        notes.append(f"new {m} was still unloading {unload_s:.0f} s later: left in place")
        except ApplyError as exc:  # no index: what runs is unknown, so every directory stays
            return [*notes, f"could not tell whether the new models are unloaded ({exc}): "
                            f"left in place: {', '.join(c.model for c in new)}"]
        for c in new:
            if c.model not in kept:  # what the repository held before (a directory no model was loaded from), or nothing
                before = backup.get(c.model)
                generator.write_model(self.repository, c.model, before.files if before is not None else None)
        return notes

    def _settled(self, models: set[str], passing: set[str], wait_s: float) -> dict[str, set[str]]:
        """The repository index's states of each model, read until none of ``models`` is in a ``passing``
        state, or for ``wait_s`` at most."""
        deadline = time.monotonic() + wait_s
        while True:
            states = self._states()
            if not any(states.get(m, set()) & passing for m in models) or time.monotonic() >= deadline:
                return states
            time.sleep(0.2)

    def _states(self) -> dict[str, set[str]]:
        """The states of each model of the repository index, one per version ("": never loaded)."""
        out: dict[str, set[str]] = {}
        with self._failing_as_apply():
            for m in self.control.index():
                out.setdefault(m.name, set()).add(m.state)
        return out
