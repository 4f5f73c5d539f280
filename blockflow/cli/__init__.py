"""The ``blockflow`` command line: presentation only — parse the arguments, call the layers
below (``blockflow.control``, ``blockflow.plan``, ``clients``, ``bench``), print the result.

Commands import what they call inside their bodies: ``blockflow --help`` and the quick commands
then start without importing torch, Triton's client or the benchmark harness.
"""

from blockflow.cli import apply, plan_memory, plans, serve, status, tasks, tools  # noqa: F401  (each registers its commands on `app`)
from blockflow.cli.app import app, main

__all__ = ["app", "main"]
