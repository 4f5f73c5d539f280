"""The one-server A/B bench: two plans' first tasks side by side under prefixed names, and its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockflow.bench import ab
from blockflow.core.errors import BlockFlowError
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "plans" / "bench_r50.yaml"


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    text = BENCH.read_text()
    assert old in text, "plans/bench_r50.yaml changed: fix the test's edit"
    out = tmp_path / "b.yaml"
    out.write_text(text.replace(old, new, 1))
    return out


def test_both_first_tasks_are_served_side_by_side_with_their_own_settings(tmp_path: Path) -> None:
    b = _variant(tmp_path, "b0: {model: r50, stages: 0,", "b0: {model: r50, stages: 0, instances: 2,")
    plan, models = ab.merged(load_plan(BENCH), load_plan(b), precision="fp16")
    assert models == {"a": "a_r50", "b": "b_r50", "graph": "a_r50__ref_graph"}
    assert plan.tasks["a_r50"].path == ("a_b0", "a_b1", "a_b2", "a_b3")
    assert plan.tasks["b_r50"].path == ("b_b0", "b_b1", "b_b2", "b_b3")
    assert (plan.blocks["a_b0"].instances, plan.blocks["b_b0"].instances) == (1, 2)
    assert {blk.precision for blk in plan.blocks.values()} == {"fp16"}
    # The plan's defaults (no batching delay) reach every block of both sides.
    assert {blk.batching_delay_us for blk in plan.blocks.values()} == {load_plan(BENCH).blocks["b0"].batching_delay_us}
    assert plan.raw.compare == [] and plan.raw.references == ["graph"]


def test_plans_that_differ_outside_their_blocks_are_refused(tmp_path: Path) -> None:
    text = BENCH.read_text()
    b = tmp_path / "b.yaml"
    b.write_text(text + "\nfuse: auto\n" if "fuse:" not in text else text.replace("fuse: none", "fuse: auto"))
    with pytest.raises(BlockFlowError, match="differ in fuse"):
        ab.merged(load_plan(BENCH), load_plan(b))


def test_the_report_gives_each_round_b_minus_a() -> None:
    def runs(values: list[float], key: str) -> list[dict[str, float]]:
        return [{key: v} for v in values]

    res = {"meta": {"device": "H100", "commit": "abc1234", "a": "A.yaml", "b": "B.yaml", "precision": "fp16", "rounds": 2,
                    "seconds": 1.0, "models": {"a": "a_t", "b": "b_t", "graph": "a_t__ref_graph"}},
           "runs": {"a|c1": runs([3.0, 3.2], "p50_ms"), "b|c1": runs([2.5, 3.3], "p50_ms"), "graph|c1": runs([2.0, 2.1], "p50_ms"),
                    "a|c32": runs([2000, 2100], "throughput"), "b|c32": runs([2200, 2150], "throughput")}}
    text = ab.report(res)
    assert "| c1 | p50_ms | 3.100 ms | 2.900 ms | 2.050 ms | -0.500, +0.100 | 1 of 2 |" in text
    assert "| c32 | throughput | 2050/s | 2175/s | — | +200, +50 | 0 of 2 |" in text
