"""Investigations: measurements run to answer one question, whose findings the docs hold (docs/performance.md,
docs/triton-notes.md). Kept runnable from a checkout (``python -m blockflow.bench.lab.NAME``); the wheel leaves them out,
and nothing outside this package imports them."""
