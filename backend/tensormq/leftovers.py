"""What a producer leaves in the file system: its socket, its claim table and, for a host pool, the
pool's shared memory. A producer removes its own on its way out, and what earlier generations of
its instance left when they were killed as it starts."""

from __future__ import annotations

from pathlib import Path

from blockflow.backend.tensormq.claims import claims_path
from blockflow.backend.tensormq.memory import SHM_DIR
from blockflow.backend.tensormq.wire import generations, listening, socket_path
from blockflow.core import env


def remove_generation(runtime_dir: Path, pid: int, generation: int) -> None:
    """Unlink one generation's files (socket first, so no consumer finds it while they go), without
    touching a lock or an open object: what a process may do on its way out."""
    path = socket_path(runtime_dir, pid, generation)
    path.unlink(missing_ok=True)
    claims_path(path).unlink(missing_ok=True)
    # A host pool is memory: a tritonserver started by hand and SIGKILLed has nobody else to free it.
    (SHM_DIR / env.pool_shm_name(runtime_dir, pid, generation)).unlink(missing_ok=True)


def remove_dead_generations(runtime_dir: Path, pid: int) -> None:
    """The files of every earlier generation of producer ``pid`` that no longer listens."""
    for gen in generations(runtime_dir, pid):
        if not listening(socket_path(runtime_dir, pid, gen)):
            remove_generation(runtime_dir, pid, gen)
