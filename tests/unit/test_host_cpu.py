"""The host's CPU per inference between two snapshots (bench/host_cpu.py)."""

from __future__ import annotations

import os
import time

from blockflow.bench import host_cpu
from blockflow.bench.host_cpu import HostCpu
from blockflow.core import procfs


def test_per_inference_splits_the_windows_cpu_by_process_kind() -> None:
    before = HostCpu(server=1.0, blocks={"b0": {10: 2.0}, "b1": {11: 3.0, 12: 5.0}, "ref": {13: 1.0}}, front_door={20: 0.5}, client=4.0)
    # b1's pid 12 ended within the window (its lifetime must not cancel 11's work); pid 14 started (counts whole).
    after = HostCpu(server=1.2, blocks={"b0": {10: 2.5}, "b1": {11: 3.1, 14: 0.2}, "ref": {13: 1.01}}, front_door={20: 0.6}, client=4.4)
    cpu = host_cpu.per_inference(before, after, inferences=100, own=frozenset({"split", "b0", "b1"}))
    assert cpu == {"server": 2.0, "front_door": 1.0, "client": 4.0, "blocks": {"b0": 5.0, "b1": 3.0, "ref": 0.1},
                   "own_blocks": 8.0, "total": 15.1}


def test_a_process_cpu_time_grows_with_its_work_and_a_gone_one_is_left_out() -> None:
    t0 = procfs.cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert procfs.cpu_seconds(os.getpid()) - t0 >= 0.1
    assert set(host_cpu.cpu_of([os.getpid(), 2**22 + 7])) == {os.getpid()}  # above pid_max's default: no such process
