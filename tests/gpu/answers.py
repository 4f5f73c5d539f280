"""When two answers to the same images count as the same on the GPU machine.

A block with ``placement: gpu`` runs an instance on every GPU, and each instance's process picks its own cuDNN
algorithms (``cudnn.benchmark``), so the same images may come back from two instances a few fp16 roundings apart
(5e-4 of the largest logit on two H200s). Images that went astray would be ~1 apart; bytes that arrived intact
and ran in one instance are exactly equal, which one GPU still shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from blockflow.bench.agreement import relative_error

# Of the largest value: ten times the rounding seen between two instances' algorithms, far below a wrong image's.
SAME_ANSWER = 5e-3


def assert_same_answer(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    """``got`` has ``want``'s shape and is within :data:`SAME_ANSWER` of it (exactly equal on one GPU's one instance)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = relative_error(got.astype(np.float64), want.astype(np.float64))
    assert err <= SAME_ANSWER, f"relative error {err:.2e} against the host input's answer"
