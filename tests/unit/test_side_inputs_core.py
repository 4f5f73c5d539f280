"""Side inputs of an exported program: found, never carried by a hop, handed to the stages that read them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from blockflow.core import arch
from blockflow.core.side_inputs import side_inputs, stage_side_inputs
from blockflow.core.spec import SideInput

from .. import side_programs


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("side")
    return {"sized_boxes": side_programs.sized_boxes(where), "scaled": side_programs.scaled(where)}


SIDES = {"sized_boxes": torch.tensor([[480, 640], [32, 16], [7, 9]]), "scaled": torch.tensor([[0.5], [1.25], [2.0]])}


def _run_stages(path: Path, cuts: list[str], image: torch.Tensor, side: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
    """The program run as its stages one after another, each given its hop tensors then its side inputs."""
    net = arch.build_network(str(path), 0, 0)
    xs: tuple[torch.Tensor, ...] = (image,)
    for i in range(len(cuts) + 1):
        reads = stage_side_inputs(str(path), cuts, (), 0, i, i)
        assert set(reads) <= {name}
        out = arch.slice_stages(net, str(path), cuts, i, i)(*xs, *(side for _ in reads))
        xs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return xs


def _whole(path: Path, image: torch.Tensor, side: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = torch.export.load(path).module()(image, side)
    return tuple(out.values()) if isinstance(out, dict) else (out,)


def test_the_side_inputs_and_the_stages_that_read_them(programs: dict[str, Path]) -> None:
    boxes, scaled = str(programs["sized_boxes"]), str(programs["scaled"])
    assert side_inputs(boxes, (), 0) == (SideInput(name="size", dtype="int64", shape=(2,)),)
    assert side_inputs(scaled, (), 0) == (SideInput(name="scale", dtype="fp32", shape=(1,)),)
    assert side_inputs("resnet18", (3, 32, 32), 10) == ()
    assert stage_side_inputs("resnet18", ["layer2"], (3, 32, 32), 10, 0, 1) == ()
    for cuts in (["stem"], ["body"], ["box"], ["stem", "body"]):
        assert [stage_side_inputs(boxes, cuts, (), 0, i, i) for i in range(len(cuts) + 1)] == \
            [*([()] * len(cuts)), ("size",)]
        assert stage_side_inputs(boxes, cuts, (), 0, 0, len(cuts)) == ("size",)
    # ``scale`` weighs the stem's features (read just after the stem) and is added to the logits.
    assert [stage_side_inputs(scaled, ["body"], (), 0, i, i) for i in range(2)] == [("scale",), ("scale",)]
    assert [stage_side_inputs(scaled, ["stem", "body"], (), 0, i, i) for i in range(3)] == [(), ("scale",), ("scale",)]
    with pytest.raises(ValueError, match="'bodi' is not a legal cut"):
        stage_side_inputs(scaled, ["bodi"], (), 0, 0, 0)
    # Task outputs are named as before.
    assert [(o.name, o.dtype, o.shape) for o in arch.task_outputs(boxes, ())] == [("boxes", "fp32", (4,)), ("area", "int64", (1,))]


@pytest.mark.parametrize("name", ["sized_boxes", "scaled"])
def test_no_hop_carries_a_side_input(programs: dict[str, Path], name: str) -> None:
    path = str(programs[name])
    cuts = arch.legal_cuts(path, (), 0)
    assert {"stem", "body"} <= set(cuts.names())
    traced = arch.trace(arch.build_network(path, 0, 0))
    side = traced.nodes[traced.sides[0]]
    assert [side.name] == [s.name for s in cuts.sides]
    for cut in cuts.cuts:
        live = traced.live_after(cuts.position(cut.name))
        assert side not in live and len(live) == len(cut.tensors), cut
    if name == "sized_boxes":
        box = cuts.get("box")  # legal though ``size`` is read after it
        assert box is not None and box.shapes == ((4,),)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", ["sized_boxes", "scaled"])
def test_stages_given_their_side_inputs_equal_the_program_run_whole(programs: dict[str, Path], name: str, batch: int) -> None:
    path = programs[name]
    image, side = torch.randn(batch, 3, 16, 16), SIDES[name][:batch]
    splits = [[c] for c in arch.legal_cuts(str(path), (), 0).names()] + [["stem", "body"]]
    with torch.no_grad():
        want = _whole(path, image, side)
        for cuts in splits:
            got = _run_stages(path, cuts, image, side, side_inputs(str(path), (), 0)[0].name)
            assert len(got) == len(want), cuts
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and torch.allclose(g, w, rtol=0, atol=1e-6), (cuts, (g - w).abs().max())


def test_a_stage_takes_its_entering_tensors_then_its_side_inputs(programs: dict[str, Path]) -> None:
    path = str(programs["scaled"])
    traced = arch.trace(arch.build_network(path, 0, 0))
    first = arch.stage_module(traced, ["stem"], 0, 0)
    last = arch.stage_module(traced, ["stem"], 1, 1)

    def arguments(m: torch.fx.GraphModule) -> list[str]:
        return [str(n.target) for n in m.graph.nodes if n.op == "placeholder"]

    assert arguments(first) == ["image"]  # the stem reads no ``scale``
    assert arguments(last) == ["x", "scale"]
    assert arguments(arch.stage_module(traced, [], 0, 0)) == ["image", "scale"]


class _X(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 2, 1)
        self.head = nn.Linear(32, 2)

    def forward(self, image: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(image).flatten(1)) * x


def test_a_side_input_named_like_a_hop_tensor_keeps_its_own_argument(tmp_path: Path) -> None:
    path = str(_export(_X(), torch.rand(3, 1), lambda b: ({0: b}, {0: b}), tmp_path / "x.pt2"))
    net = arch.build_network(path, 0, 0)
    stage = arch.slice_stages(net, path, ["stem"], 1, 1)
    assert [str(n.target) for n in stage.graph.nodes if n.op == "placeholder"] == ["x_", "x"]
    image, x = torch.randn(2, 3, 4, 4), torch.rand(2, 1)
    with torch.no_grad():
        assert torch.equal(stage(arch.slice_stages(net, path, ["stem"], 0, 0)(image), x), net(image, x))


class _Side(nn.Module):
    def forward(self, image: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        return image.flatten(1)[:, :1] * side.float().reshape(image.shape[0], -1)[:, :1]


class _Unrelated(nn.Module):  # the side input's batch is not tied to the image's
    def forward(self, image: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        return image.flatten(1)[:, :1] * side.sum()


class _Named(nn.Module):
    def forward(self, image: torch.Tensor, IMAGE: torch.Tensor) -> torch.Tensor:  # noqa: N803
        return image.flatten(1)[:, :1] * IMAGE


class _OriginalSize(nn.Module):  # a detector's side input, which its block (not a stage) reads
    def forward(self, image: torch.Tensor, ORIGINAL_SIZE: torch.Tensor) -> torch.Tensor:  # noqa: N803
        return image.flatten(1)[:, :1] * ORIGINAL_SIZE


class _Boxes(nn.Module):
    def forward(self, image: torch.Tensor, boxes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"boxes": image.flatten(1)[:, :4] * boxes, "count": boxes.sum(1, keepdim=True)}


def _export(model: nn.Module, side: torch.Tensor, shapes: Callable[[torch.export.Dim], tuple[object, ...]], path: Path) -> Path:
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.export.save(torch.export.export(model, (torch.randn(3, 3, 4, 4), side), dynamic_shapes=shapes(batch)), path)
    return path


@pytest.mark.parametrize(("model", "side", "shapes", "fragment"), [
    (_Side(), torch.randn(3, 2).half(), lambda b: ({0: b}, {0: b}), "is float16; a side input is float32 or int64"),
    (_Unrelated(), torch.randn(3, 2), lambda b: ({0: b}, None), "no dynamic batch first (shape [3, 2]); give it the image's batch"),
    (_Side(), torch.randn(3), lambda b: ({0: b}, {0: b}), "one value per sample ([batch]); export it as [batch, 1]"),
    (_Side(), torch.randn(3, 5), lambda b: ({0: b}, {0: b, 1: torch.export.Dim("n")}),
     "dynamic dimensions besides the batch; export it with a fixed per-sample shape"),
    (_Unrelated(), torch.randn(4, 2), lambda b: ({0: b}, {0: torch.export.Dim("other")}), "a batch of its own; it must share the image's batch"),
    (_Named(), torch.randn(3, 1), lambda b: ({0: b}, {0: b}), "'IMAGE' is not a name a task input can take; rename the argument"),
    (_Boxes(), torch.randn(3, 4), lambda b: ({0: b}, {0: b}), "'boxes' is an output's name too; rename the argument"),
    (_OriginalSize(), torch.randn(3, 1), lambda b: ({0: b}, {0: b}), "'ORIGINAL_SIZE' is not a name a task input can take"),
])
def test_a_bad_side_input_is_refused_saying_how_to_export_it(tmp_path: Path, model: nn.Module, side: torch.Tensor,
                                                             shapes: Callable[[torch.export.Dim], tuple[object, ...]],
                                                             fragment: str) -> None:
    path = _export(model, side, shapes, tmp_path / "bad.pt2")
    with pytest.raises(ValueError, match="side input") as err:
        arch.legal_cuts(str(path), (), 0)
    assert fragment in str(err.value), err.value


def test_a_stage_file_takes_all_its_inputs_as_hop_tensors(tmp_path: Path) -> None:
    from blockflow.core import stage_files

    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    batch = torch.export.Dim("batch")
    path = tmp_path / "stage1.pt2"
    torch.export.save(torch.export.export(Add(), (torch.randn(2, 4), torch.randn(2, 4)), dynamic_shapes=({0: batch}, {0: batch})), path)
    stage = stage_files.load_stage_file(str(path))
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(stage(a, b), a + b)
    assert stage_files.stage_file_shapes([str(path)], None) == [(((4,), (4,)), ((4,),))]
