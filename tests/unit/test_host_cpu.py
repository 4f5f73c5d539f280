"""The host's CPU per inference between two snapshots (bench/host_cpu.py)."""

from __future__ import annotations

import os
import threading
import time

from blockflow.bench import host_cpu
from blockflow.bench.host_cpu import HostCpu
from blockflow.core import procfs, threads


def test_per_inference_splits_the_windows_cpu_by_process_kind() -> None:
    before = HostCpu(server=1.0, blocks={"b0": {10: 2.0}, "b1": {11: 3.0, 12: 5.0}, "ref": {13: 1.0}}, front_door={20: 0.5}, client=4.0)
    # b1's pid 12 ended within the window (its lifetime must not cancel 11's work); pid 14 started (counts whole).
    after = HostCpu(server=1.2, blocks={"b0": {10: 2.5}, "b1": {11: 3.1, 14: 0.2}, "ref": {13: 1.01}}, front_door={20: 0.6}, client=4.4)
    cpu = host_cpu.per_inference(before, after, inferences=100, own=frozenset({"split", "b0", "b1"}))
    assert cpu == {"server": 2.0, "front_door": 1.0, "client": 4.0, "blocks": {"b0": 5.0, "b1": 3.0, "ref": 0.1},
                   "own_blocks": 8.0, "total": 15.1, "threads": {}}


def test_per_inference_names_the_busy_threads_of_the_server_and_of_each_model() -> None:
    before = HostCpu(server=1.0, blocks={}, front_door={}, client=0.0,
                     threads={"tritonserver": {1: {"main": 0.5, "http": 1.0}},
                              "b0": {10: {"main": 2.0, "tmq-releaser": 1.0}, 11: {"main": 5.0}}})
    # b0's pid 11 ended within the window (its time must not cancel pid 10's); pid 12 started (counts whole).
    after = HostCpu(server=1.4, blocks={}, front_door={}, client=0.0,
                    threads={"tritonserver": {1: {"main": 0.5, "http": 1.4}},
                             "b0": {10: {"main": 2.3, "tmq-releaser": 1.0, "bf-link": 0.1}, 12: {"main": 0.05}}})
    cpu = host_cpu.per_inference(before, after, inferences=100)
    # Idle threads are left out; a thread that started within the window counts whole.
    assert cpu["threads"] == {"tritonserver": {"http": 4.0}, "b0": {"bf-link": 1.0, "main": 3.5}}


def test_a_named_thread_carries_its_name_to_the_kernel_and_its_cpu_to_that_name() -> None:
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait(10)

    t = threads.named_thread(spin, "bf-test-spinner-long-name")
    t.start()
    try:
        assert spun.wait(60)  # its 0.2 s of CPU, however busy the machine
        by_name = procfs.thread_cpu(os.getpid())
        assert t.name == "bf-test-spinner-long-name"
        assert by_name["bf-test-spinner"] >= 0.1  # the kernel's 15 bytes
        assert "main" in by_name
    finally:
        done.set()
        t.join()
    assert procfs.thread_cpu(2**22 + 7) == {}


def test_a_process_cpu_time_grows_with_its_work_and_a_gone_one_is_left_out() -> None:
    t0 = procfs.cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert procfs.cpu_seconds(os.getpid()) - t0 >= 0.1
    assert set(host_cpu.cpu_of([os.getpid(), 2**22 + 7])) == {os.getpid()}  # above pid_max's default: no such process


def test_the_report_names_the_busiest_threads_busiest_first() -> None:
    cpu = {"threads": {"tritonserver": {"tritonserver": 0.35, "cuda-EvtHandlr": 0.004}, "b3": {"main": 0.229, "tmq-releaser": 0.009},
                       "b1": {"bf-link": 0.053}}}
    assert host_cpu.busiest_threads(cpu, top=3) == "tritonserver tritonserver 0.350; b3 main 0.229; b1 bf-link 0.053"
    assert host_cpu.busiest_threads(None) == host_cpu.busiest_threads({"threads": {}}) == "—"
