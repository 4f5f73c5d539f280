"""Task inputs besides the image on the GPU: the two exported programs of ``tests.side_programs`` cut in
two, fp16 blocks, on TensorMQ and on Triton's GPU tensors. ``scaled``'s blocks replay CUDA graphs that
hold its fp32 ``scale`` as a static input; ``sized``'s last block (named outputs) runs eagerly, and its
int64 ``size`` stays an integer (``area`` is exact). What fp16 computes is within its bound of the
program run whole in fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from blockflow.bench.agreement import relative_error
from blockflow.clients.client import TaskClient

from .. import side_programs
from .small_plan import served

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    where = tmp_path_factory.mktemp("side_gpu")
    sized, scaled = side_programs.sized_boxes(where), side_programs.scaled(where)
    plan = yaml.safe_dump({
        "version": 1, "name": "side-gpu", "compare": ["triton-gpu"],
        "models": {"sized": {"program": str(sized), "cut_points": ["body"]},
                   "scaled": {"program": str(scaled), "cut_points": ["body"]}},
        "defaults": {"placement": "gpu", "max_batch_size": 4, "precision": "fp16"},
        "blocks": {"sg_a": {"model": "sized", "stages": 0}, "sg_b": {"model": "sized", "stages": 1},
                   "sc_a": {"model": "scaled", "stages": 0}, "sc_b": {"model": "scaled", "stages": 1}},
        "tasks": {"sized": {"path": ["sg_a", "sg_b"]}, "scaled": {"path": ["sc_a", "sc_b"]}}})
    with served(where, plan) as s:
        yield s.http_url, sized, scaled


def _whole(program: Path, image: np.ndarray, side: np.ndarray) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        out = torch.export.load(program).module()(torch.from_numpy(image), torch.from_numpy(side))
    return {k: v.numpy() for k, v in out.items()} if isinstance(out, dict) else {"LOGITS": out.numpy()}


@pytest.mark.parametrize("variant", ["", "__triton_gpu"])
def test_side_inputs_reach_graphed_fp16_blocks_on_both_transports(server: tuple[str, Path, Path], variant: str) -> None:
    url, sized, scaled = server
    with TaskClient(url) as c:
        for batch in (1, 3):
            rng = np.random.default_rng(batch)
            image = rng.standard_normal((batch, 3, 16, 16), dtype=np.float32)
            size = rng.integers(16, 4000, (batch, 2), dtype=np.int64)
            got = c.infer_outputs(f"sized{variant}", image, inputs={"size": size})
            want = _whole(sized, image, size)
            assert relative_error(got["boxes"], want["boxes"]) <= 1e-2
            assert got["area"].dtype == np.int64 and np.array_equal(got["area"], want["area"])
            scale = rng.uniform(0.5, 2.0, (batch, 1)).astype(np.float32)
            logits = c.infer(f"scaled{variant}", image, inputs={"scale": scale})
            assert relative_error(logits, _whole(scaled, image, scale)["LOGITS"]) <= 1e-2
