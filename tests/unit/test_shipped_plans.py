"""Every plan BlockFlow ships (``plans/``, ``plans/examples/``) loads and renders a repository whose configs
Triton's schema takes (a plan over several servers: each server's); the speed command's plan keeps its
chain and instances in each like_for_like row. The examples cut from an exported program need it exported
first: tests/unit/test_program.py renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockflow.bench.like_for_like import ROWS, row_plan
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in [*(ROOT / "plans").glob("*.yaml"), *(ROOT / "plans" / "examples").glob("*.yaml")]
                 if not p.stem.startswith("skipnet"))
SPEED = ROOT / "plans" / "bench_r50_speed.yaml"


@pytest.mark.parametrize("plan", SHIPPED, ids=[p.relative_to(ROOT / "plans").as_posix() for p in SHIPPED])
def test_a_shipped_plan_loads_and_renders(plan: Path) -> None:
    loaded = load_plan(plan)
    for server in loaded.raw.servers or [None]:
        files = generator.render(loaded.on_server(server))
        configs = {path: data for path, data in files.items() if path.endswith("config.pbtxt")}
        assert configs
        for path, data in configs.items():
            assert parse_pbtxt(data.decode()).name == path.split("/")[0]


@pytest.mark.parametrize("row", ["fp16_host", "fp16_u8_host", "fp16_u8_cudashm", "fp16_jpeg_host", "fp16_cudashm"])
def test_the_speed_plan_serves_each_row_as_a_chain_in_its_own_instances(row: str, tmp_path: Path) -> None:
    served = load_plan(row_plan(next(r for r in ROWS if r.name == row), SPEED, tmp_path, None))
    assert {name: b.instances for name, b in served.blocks.items()} == {"b0": 2, "b1": 4, "b2": 4, "b3": 8}
    assert served.raw.hand_over == "chain" and served.raw.reference_instances == 4
    files = generator.render(served)
    ensemble = parse_pbtxt(files["r50/config.pbtxt"].decode())
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["b0", "b3"]  # the links run off the ensemble
