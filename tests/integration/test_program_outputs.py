"""An exported program of several outputs (a dict of logits, an embedding and an int64 class),
cut in two and served on a real tritonserver of this module's own: the task answers each output
under the program's own key, in its dtype, equal to the program run whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from blockflow.clients.client import TaskClient
from blockflow.core import arch, programs
from blockflow.core.errors import ClientError
from blockflow.plan import load_plan

from ..conftest import own_server

pytestmark = pytest.mark.integration


class ThreeHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.cls = torch.nn.Linear(8, 10)
        self.emb = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.stem(x).relu().mean((2, 3))
        logits = self.cls(h)
        return {"logits": logits, "embedding": self.emb(h), "top": logits.argmax(1)}


def _export(where: Path) -> Path:
    torch.manual_seed(0)
    model = ThreeHeads().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, (torch.randn(2, 3, 16, 16),), dynamic_shapes=({0: batch},))
    path = where / "three_heads.pt2"
    torch.export.save(program, path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    where = tmp_path_factory.mktemp("program_outputs")
    program = _export(where)
    plan = where / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "version": 1, "name": "three-heads", "models": {"m": {"program": program.name, "cut_points": ["relu"]}},
        "defaults": {"placement": "cpu", "max_batch_size": 4},
        "blocks": {"th_a": {"model": "m", "stages": 0}, "th_b": {"model": "m", "stages": 1}},
        "tasks": {"three": {"path": ["th_a", "th_b"]}}}))
    with own_server(load_plan(plan), where) as server:
        yield server.http_url, program


def test_every_output_answers_under_its_key_as_the_program_does(served: tuple[str, Path]) -> None:
    url, program = served
    whole = torch.export.load(program).module()
    with TaskClient(url) as c:
        assert c.input_of("three").outputs == ("logits", "embedding", "top")
        for batch in (1, 3):
            x = np.random.default_rng(batch).standard_normal((batch, 3, 16, 16), dtype=np.float32)
            got = c.infer_outputs("three", x)
            with torch.inference_mode():
                want = {k: v.numpy() for k, v in whole(torch.from_numpy(x)).items()}
            np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got["embedding"], want["embedding"], rtol=1e-5, atol=1e-6)
            assert got["top"].dtype == np.int64 and got["top"].shape == (batch, 1)
            assert np.array_equal(got["top"][:, 0], want["top"])
        with pytest.raises(ClientError, match="answers logits, embedding, top, not LOGITS: call infer_outputs"):
            c.infer("three", np.zeros((1, 3, 16, 16), dtype=np.float32))


def test_keys_triton_cannot_take_answer_as_numbered_outputs(tmp_path: Path) -> None:
    class Odd(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"a b": x.mean((1, 2, 3)), "IMAGE": x.amax((1, 2, 3))}

    batch = torch.export.Dim("batch", min=1, max=1024)
    path = tmp_path / "odd.pt2"
    torch.export.save(torch.export.export(Odd(), (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: batch},)), path)
    assert programs.program_output_names(str(path), 2) == ["OUTPUT_0", "OUTPUT_1"]
    assert [(o.name, o.shape) for o in arch.task_outputs(str(path), (3, 8, 8))] == [("OUTPUT_0", (1,)), ("OUTPUT_1", (1,))]
