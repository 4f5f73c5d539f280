"""``blockflow.core.cuda.set_schedule`` refuses a wait mode it does not know before touching the driver."""

from __future__ import annotations

import pytest

from blockflow.core import cuda
from blockflow.core.errors import BlockError


def test_an_unknown_wait_mode_is_refused_by_name() -> None:
    with pytest.raises(BlockError, match="unknown CUDA wait mode 'sometimes' .BLOCKFLOW_CUDA_SCHEDULE.: one of auto, spin, yield, blocking"):
        cuda.set_schedule(0, "sometimes")
