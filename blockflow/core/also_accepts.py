"""The blocks a reloaded TensorMQ block also takes tickets from, for a while, during a live plan change.

A TensorMQ block takes tickets only from the blocks that feed it in the plan (its spec's
``accepts_from``). A plan change that gives a block other feeders reloads it, and until every
task's ensemble runs its new path, requests on an old path still bring the new block tickets from
its old feeders (and, when a failed change is undone, requests on a new path bring the restored
block tickets from its new ones). ``blockflow apply`` writes this file into such a block's model
directory, next to ``config.pbtxt``, naming those other feeders; the block accepts their tickets
too (and, a receiver of direct hand-overs, the other blocks whose tickets key them) until
``until``, which apply sets, once the change is complete, to the plan's ``lease_s`` from then: no ticket issued on an old path is still claimable after that. (Until then the file says
four load timeouts from the start, the most a change's waves may take, so an applier that dies
mid-change leaves the block widened for that long at most.)

Who writes it can already change what the server runs (the model repository), so the block
trusts it as it trusts its config; a file it cannot read or parse widens nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

FILE = "also_accepts.json"


class AlsoAccepts(BaseModel):
    """The feeders' Triton model names, and until when (Unix time) their tickets are accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: tuple[str, ...] = ()
    # A receiver of direct hand-overs whose keys come from other blocks (its sender's feeders
    # changed): the tickets of these blocks are keys too, as its old (or new) ensemble gives them.
    keys: tuple[str, ...] = ()
    until: float = 0.0

    def dumps(self) -> bytes:
        return self.model_dump_json().encode()


def write(model_dir: Path, also: AlsoAccepts) -> None:
    """Replace ``model_dir``'s file atomically (a block may be reading it)."""
    tmp = model_dir / f".{FILE}.tmp"
    tmp.write_bytes(also.dumps())
    os.replace(tmp, model_dir / FILE)


class Reader:
    """A block's view of its file: read again only when it changed on disk (called on refusals only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._also = AlsoAccepts()

    def current(self) -> AlsoAccepts:
        """What the file widens now: nothing once ``until`` has passed, or without a readable file."""
        try:
            st = os.stat(self.path)
        except OSError:
            return AlsoAccepts()
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._seen = seen
            try:
                self._also = AlsoAccepts.model_validate_json(self.path.read_bytes())
            except (OSError, ValidationError):
                self._also = AlsoAccepts()
        return self._also if time.time() < self._also.until else AlsoAccepts()
