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
        assert got == {} or set(got) == {"models", "all"}
    else:
        assert sampler.process_sm_pct(time.time() - 1, {"me": [1]}) == {}
