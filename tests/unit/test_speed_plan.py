"""The speed command's plan (``scripts/bench_speed.sh``) keeps its chain and instances in each like_for_like row
(every shipped plan renders: tests/unit/test_generator.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockflow.bench.like_for_like import ROWS, row_plan
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
SPEED = ROOT / "plans" / "bench_r50_speed.yaml"


@pytest.mark.parametrize("row", ["fp16_host", "fp16_u8_host", "fp16_u8_cudashm", "fp16_jpeg_host", "fp16_cudashm"])
def test_the_speed_plan_serves_each_row_as_a_chain_in_its_own_instances(row: str, tmp_path: Path) -> None:
    served = load_plan(row_plan(next(r for r in ROWS if r.name == row), SPEED, tmp_path, None))
    assert {name: b.instances for name, b in served.blocks.items()} == {"b0": 2, "b1": 4, "b2": 4, "b3": 8}
    assert served.raw.hand_over == "chain" and served.raw.reference_instances == 4
    files = generator.render(served)
    ensemble = parse_pbtxt(files["r50/config.pbtxt"].decode())
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["b0", "b3"]  # the links run off the ensemble
