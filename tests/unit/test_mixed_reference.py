"""The unsplit reference of a path whose blocks run in different precisions runs each part in its
block's precision, so it equals the split on the CPU (bf16 trunk, fp32 head: tests/plans/bf16_hops.yaml)."""

from __future__ import annotations

from pathlib import Path

import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan

PLAN = Path(__file__).resolve().parents[1] / "plans" / "bf16_hops.yaml"


def test_a_mixed_path_has_a_reference_in_each_blocks_precision_and_an_fp32_one() -> None:
    plan = load_plan(PLAN)
    task = plan.tasks["task_a"]
    spec, deploy = generator.reference_spec(plan, task, graph=False)
    assert spec.precision == deploy.precision == "bf16"
    assert [p.precision for p in spec.parts] == [None, "fp32"]
    fp32, _ = generator.reference_spec(plan, task, graph=False, fp32=True)
    assert fp32.precision == "fp32" and all(p.precision is None for p in fp32.parts)
    assert plan.reference_models(task) == ["task_a__ref", "task_a__ref_fp32"]
    # Reports name each block's precision, not the fp32 that task_precision falls back to.
    assert plan.task_precision(task) == "fp32"
    assert plan.precision_label(task) == "mixed: trunk bf16, head_a fp32"


def test_the_mixed_reference_equals_its_blocks_run_one_after_the_other() -> None:
    plan = load_plan(PLAN)
    cpu = torch.device("cpu")
    reference = BlockRunner(generator.reference_spec(plan, plan.tasks["task_a"], graph=False)[0], cpu)
    trunk = BlockRunner(generator.block_spec(plan, plan.blocks["trunk"], "tensormq"), cpu)
    head = BlockRunner(generator.block_spec(plan, plan.blocks["head_a"], "tensormq"), cpu)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        split = head.run_all(trunk.run_all([x]))[0]
        whole = reference.run(x)
        fp32 = BlockRunner(generator.reference_spec(plan, plan.tasks["task_a"], graph=False, fp32=True)[0], cpu).run(x)
    assert whole.dtype == split.dtype == torch.float32
    assert torch.equal(whole, split)
    assert not torch.equal(whole, fp32)  # the trunk's bf16 rounding is in both, not in the fp32 network


def test_a_path_mixing_tf32_keeps_an_fp32_reference() -> None:
    """TF32 is a switch of the whole process: such a path's reference is fp32 throughout."""
    import yaml

    from blockflow.plan import parse_plan

    raw = yaml.safe_load(PLAN.read_text())
    raw["blocks"]["trunk"]["precision"] = "tf32"
    plan = parse_plan(raw, source="tf32 trunk")
    spec, _ = generator.reference_spec(plan, plan.tasks["task_a"], graph=False)
    assert spec.precision == "fp32" and all(p.precision is None for p in spec.parts)
