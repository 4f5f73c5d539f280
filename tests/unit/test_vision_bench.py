"""The vision bench's check of logits and maps against the reference's."""

from __future__ import annotations

import numpy as np

from blockflow.bench.vision import logits_agree


def test_logits_and_maps() -> None:
    want = np.zeros((1, 2, 2, 2), np.float32)
    want[0, 0] = 1.0
    got = want.copy()
    got[0, 1, 0, 0] = 2.0  # one pixel changes class
    e = logits_agree(got, want)
    assert e["rel_err"] == 2.0 and e["pixels_agree"] == 0.75
    assert logits_agree(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)) == {"rel_err": 0.0}


def test_side_inputs_give_a_detector_its_networks_own_size() -> None:
    from pathlib import Path

    from blockflow.bench.vision import side_inputs
    from blockflow.plan import load_plan

    plan = load_plan(Path(__file__).resolve().parents[2] / "tests" / "plans" / "detect_families.yaml")
    got = side_inputs(plan, "df_fcos_t", 3)
    assert list(got) == ["ORIGINAL_SIZE"] and got["ORIGINAL_SIZE"].dtype == np.int64
    assert got["ORIGINAL_SIZE"].tolist() == [[128, 128]] * 3 and side_inputs(plan, "df_frcnn", 3) == {}
