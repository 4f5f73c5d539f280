"""The benchmarks' NVML sampler: each model's share of the GPU's time with its kernels on the SMs, from
NVML's per-process samples (read on a GPU machine by every ``blockflow bench`` run: ``gpu_sm_pct``)."""

from __future__ import annotations

import time

from blockflow.bench.nvml import GpuSampler, sm_shares


def test_a_models_share_sums_its_processes_and_all_sums_every_process_sampled() -> None:
    pct = {11: 20.0, 12: 15.5, 21: 30.0, 99: 4.0}  # 99: a process of no model (another user's, or the bench's own)
    got = sm_shares(pct, {"b0": [11, 12], "b1": [21, 22], "idle": [31]})
    assert got == {"models": {"b0": 35.5, "b1": 30.0}, "all": 69.5}


def test_no_samples_give_no_shares() -> None:
    assert sm_shares({}, {"b0": [11]}) == {}


def test_a_machine_without_nvml_samples_nothing() -> None:
    sampler = GpuSampler()
    if sampler.available:  # a GPU machine: whatever it reads has the shape the report expects
        got = sampler.process_sm_pct(time.time() - 1, {"me": [1]})
        assert got == {} or set(got) == {"models", "all", "periods"}
    else:
        assert sampler.process_sm_pct(time.time() - 1, {"me": [1]}) == {}


class _Sample:
    def __init__(self, pid: int, stamp: int, sm: int) -> None:
        self.pid, self.timeStamp, self.smUtil = pid, stamp, sm


class _Nvml:
    """NVML's per-process samples of two GPUs, as pynvml returns them (a process listed only in periods it ran)."""

    def __init__(self) -> None:
        self.since: list[int] = []

    def nvmlDeviceGetProcessUtilization(self, handle: int, since_us: int) -> list[_Sample]:
        self.since.append(since_us)
        if handle == 0:  # four periods: pid 11 ran in all, at 40%; pid 12 in two, at 30%, stamped on its own clock
            return [_Sample(11, t, 40) for t in (10, 20, 30, 40)] + [_Sample(12, t, 30) for t in (23, 31)]
        raise RuntimeError("NVML_ERROR_NOT_FOUND")  # the second GPU sampled no process since


def test_a_process_share_counts_the_periods_it_did_not_run_in_and_each_gpu_apart() -> None:
    sampler = GpuSampler.__new__(GpuSampler)
    sampler.nv, sampler.handles = _Nvml(), [0, 1]
    got = sampler.process_sm_pct(1700000000.25, {"b0": [11], "b1": [12]})
    assert got == {"models": {"b0": 40.0, "b1": 15.0}, "all": 55.0, "periods": [4]}
    assert sampler.nv.since == [1700000000250000, 1700000000250000]  # NVML's timestamps: microseconds of wall-clock time
