"""A block process's malloc thresholds: a freed batch of host inputs stays mapped for the next one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blockflow.backend import heap

# As the stub loads a batch: one new 602 kB array per image (16 images), then all of them freed.
PROBE = """
import sys
import numpy as np
import psutil
from blockflow.backend import heap
kept = heap.keep_freed_memory()
proc = psutil.Process()
for _ in range(3):  # glibc's dynamic thresholds settle after the first frees
    batch = [np.ones(3 * 224 * 224, dtype=np.float32) for _ in range(16)]
    held = proc.memory_info().rss
    del batch
    returned = held - proc.memory_info().rss
print(kept, returned)
"""


def _probe(keep: str | None) -> tuple[bool, int]:
    environ = {k: v for k, v in os.environ.items() if k != "BLOCKFLOW_KEEP_HEAP"}
    if keep is not None:
        environ["BLOCKFLOW_KEEP_HEAP"] = keep
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=environ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_batch_stays_mapped_with_the_thresholds_and_is_returned_without() -> None:
    batch = 16 * 3 * 224 * 224 * 4
    kept, returned = _probe(None)
    assert kept
    assert returned < batch // 8
    kept, returned = _probe("0")
    assert not kept
    assert returned > batch // 2


def test_the_thresholds_fit_a_batch_of_images() -> None:
    assert heap.MMAP_THRESHOLD >= 32 * 3 * 224 * 224 * 4  # a batch of 32 fp32 images, joined in one array
    assert heap.TRIM_THRESHOLD >= heap.MMAP_THRESHOLD
