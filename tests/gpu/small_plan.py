"""A two-block ResNet-18 (64×64, fp16, TensorMQ, with its unsplit graph) served on the GPU for one test module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer


def plan_text(name: str, task: str, blocks: tuple[str, str], seed: int) -> str:
    b0, b1 = blocks
    return f"""
version: 1
name: {name}
models: {{r18: {{arch: resnet18, cut_points: [layer2], input_shape: [3, 64, 64], num_classes: 10}}}}
defaults: {{placement: gpu, max_batch_size: 8, precision: fp16}}
blocks:
  {b0}: {{model: r18, stages: 0, weights: {{seed: {seed}}}}}
  {b1}: {{model: r18, stages: 1, weights: {{seed: {seed}}}}}
tasks:
  {task}: {{path: [{b0}, {b1}]}}
transport: tensormq
references: [graph]
"""


@contextmanager
def served(where: Path, plan: str) -> Iterator[TritonServer]:
    """``plan`` generated under ``where`` and served by a real tritonserver on free ports until the block ends."""
    (where / "plan.yaml").write_text(plan)
    generator.write(generator.render(load_plan(where / "plan.yaml")), where / "repo")
    s = TritonServer(ServerOptions.on_free_ports([where / "repo"]))
    s.start(600)
    try:
        yield s
    finally:
        s.stop()
