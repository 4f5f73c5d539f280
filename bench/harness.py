"""What every benchmark shares: a plan rendered into a fresh repository, served by a real
``tritonserver`` on free loopback ports (``ServerOptions.on_free_ports``), stopped afterwards.

    with served(load_plan("plans/bench_r50.yaml"), "bench-x-", cuda_pool_mb=1024) as server:
        perf_analyzer(server.http_url, ...)
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blockflow.plan import Plan
from blockflow.triton.server import ServerOptions, TritonServer
from ensemble_gen import generator


def rendered(plan: Plan, prefix: str = "bench-") -> Path:
    """The plan's model repository, written to a new temporary directory."""
    repo = Path(tempfile.mkdtemp(prefix=prefix))
    generator.write(generator.render(plan), repo)
    return repo


@contextmanager
def served(plan: Plan, prefix: str = "bench-", start_timeout: float = 900.0, **options: Any) -> Iterator[TritonServer]:
    """A server running ``plan`` (every model loaded unless ``load=`` says otherwise), for the ``with`` body."""
    server = TritonServer(ServerOptions.on_free_ports([rendered(plan, prefix)], **options))
    server.start(start_timeout)
    try:
        yield server
    finally:
        server.stop()
