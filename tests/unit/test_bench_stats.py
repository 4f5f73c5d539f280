"""bench.suite's reading of Triton's statistics (pure arithmetic)."""

from __future__ import annotations

from bench.suite import block_breakdown, compute_ms, delta


def test_compute_is_per_execution_when_requests_are_batched() -> None:
    # 10 executions of 4 batched requests each, 2 ms each: Triton adds 2 ms for every request (80 ms).
    s = {"executions": 10, "inferences": 40, "requests": 40, "compute_infer_ns": 80_000_000,
         "compute_input_ns": 0, "compute_output_ns": 0, "queue_ns": 40_000_000}
    assert compute_ms(s) == 2.0
    row = block_breakdown({"b0": s}, ["b0"], 1)[0]
    assert row["batch_per_execution"] == 4.0 and row["queue_ms"] == 1.0


def test_delta_subtracts_only_what_was_there() -> None:
    before = {"m": {"executions": 1, "requests": 1}}
    after = {"m": {"executions": 3, "requests": 5}, "n": {"executions": 2, "requests": 2}}
    assert delta(after, before) == {"m": {"executions": 2, "requests": 4}, "n": {"executions": 2, "requests": 2}}
