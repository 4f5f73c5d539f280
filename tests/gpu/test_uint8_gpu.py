"""uint8 images on the GPU: the blocks that take them convert and normalize them inside their CUDA graph,
and the split equals its unsplit graph and the float32 network given the image normalized by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from blockflow.backend.runtime import BlockRunner
from blockflow.core.spec import IMAGENET_MEAN, IMAGENET_STD
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.plan import Plan, parse_plan

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
DEV = torch.device("cuda:0")


def _plan(layout: str, precision: str, uint8: bool = True) -> Plan:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "tests" / "plans" / "uint8_hwc.yaml").read_text())
    if uint8:
        raw["models"]["r18"]["input"]["layout"] = layout
    else:
        del raw["models"]["r18"]["input"]
    raw["defaults"] = {"placement": "gpu", "max_batch_size": 8, "precision": precision}
    raw["transport"] = "triton-gpu"
    return parse_plan(raw)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["HWC", "CHW"])
def test_uint8_blocks_in_cuda_graphs_equal_the_float_network(layout: str, precision: str) -> None:
    p, f = _plan(layout, precision), _plan(layout, precision, uint8=False)
    task = p.tasks["u8_task"]
    runners = [BlockRunner(block_spec(p, p.blocks[b], "triton-gpu"), DEV) for b in task.path]
    ref = BlockRunner(reference_spec(p, task, graph=True)[0], DEV)
    flt = BlockRunner(reference_spec(f, f.tasks["u8_task"], graph=True)[0], DEV)
    assert all(r.use_graphs for r in (*runners, ref, flt))
    for r in (*runners, ref, flt):
        r.warmup()
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    given = x.permute(0, 2, 3, 1).contiguous() if layout == "HWC" else x
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    tol = 1e-3 if precision == "fp32" else 5e-2
    for batch in (1, 3, 8):
        for xb in (given[:batch], given[:batch].to(DEV)):  # host images and images already on the GPU
            y = xb
            for r in runners:
                y = r.run(y)
            by_hand = flt.run(((x[:batch].float() / 255.0 - mean) / std).to(DEV))
            assert float((y.float() - ref.run(xb).float()).abs().max()) <= tol
            assert float((y.float() - by_hand.float()).abs().max()) <= tol
