"""A model of one's own, exported with torch.export (.pt2): cut by BlockFlow, checked in a plan."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from blockflow.core import arch, stage_files
from blockflow.core.errors import PlanError
from blockflow.core.side_inputs import side_inputs
from blockflow.plan import parse_plan

ROOT = Path(__file__).resolve().parents[2]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("export_example_model", ROOT / "scripts" / "export_example_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("program") / "skipnet.pt2"
    example = _example()
    torch.export.save(example.export(example.build(3)), path)
    return path


def _run(path: Path, cuts: list[str], x: torch.Tensor) -> torch.Tensor:
    net = arch.build_network(str(path), 0, 0)
    xs: tuple[torch.Tensor, ...] = (x,)
    for i in range(len(cuts) + 1):
        out = arch.slice_stages(net, str(path), cuts, i, i)(*xs)
        xs = tuple(out) if isinstance(out, tuple) else (out,)
    return xs[0]


@pytest.mark.parametrize("cuts", [["down", "body"], ["stem", "body.0.bn1", "up.0"], ["body.1.conv2"]])
def test_stages_of_a_program_equal_the_program_run_whole(program: Path, cuts: list[str]) -> None:
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = torch.export.load(program).module()(x)
        got = _run(program, cuts, x)
    assert torch.equal(got, want)


def test_a_cut_inside_the_long_skip_carries_it(program: Path) -> None:
    cuts = arch.legal_cuts(str(program), (), 0)
    assert cuts.input_shape == (3, 32, 32) and cuts.output_shape == (10,)
    down = cuts.get("down")
    assert down is not None and down.shapes == ((16, 32, 32), (32, 16, 16))  # the stem's output, kept for the skip
    assert arch.stage_output_shapes(str(program), ["down", "body"], (), 0)[-1] == ((10,),)
    # A stage holds only its own parameters: the state_dict a weights file must match.
    net = arch.build_network(str(program), 0, 0)
    last = arch.slice_stages(net, str(program), ["down", "body"], 2, 2)
    assert sorted({k.split(".")[0] for k in last.state_dict()}) == ["head", "up"]


def test_a_program_with_a_fixed_batch_or_a_bad_second_input_is_refused(tmp_path: Path) -> None:
    fixed = tmp_path / "fixed.pt2"
    torch.export.save(torch.export.export(nn.Linear(4, 2).eval(), (torch.randn(2, 4),)), fixed)
    with pytest.raises(ValueError, match="exported for batches of exactly 2; export it with a dynamic batch"):
        arch.legal_cuts(str(fixed), (), 0)

    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * b.sum()

    batch = torch.export.Dim("batch")
    two = tmp_path / "two.pt2"  # a second input with the batch of the first: a side input
    torch.export.save(torch.export.export(Two(), (torch.randn(2, 4), torch.randn(2, 3)),
                                          dynamic_shapes=({0: batch}, {0: batch})), two)
    assert [s.name for s in side_inputs(str(two), (), 0)] == ["b"]
    other = tmp_path / "other.pt2"  # a second input of a fixed batch: no side input
    torch.export.save(torch.export.export(Two(), (torch.randn(2, 4), torch.randn(2, 3)),
                                          dynamic_shapes=({0: batch}, None)), other)
    with pytest.raises(ValueError, match="side input 'b' has no dynamic batch first"):
        arch.legal_cuts(str(other), (), 0)
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="cannot load exported program"):
        arch.legal_cuts(str(junk), (), 0)


def _plan(program: Path, tmp_path: Path) -> dict[str, Any]:
    shutil.copy(program, tmp_path / "skipnet.pt2")
    data: dict[str, Any] = yaml.safe_load((ROOT / "plans" / "examples" / "skipnet.yaml").read_text())
    del data["blocks"]["back_b"]["weights"]
    return data


def test_the_example_plan_resolves_the_program(program: Path, tmp_path: Path) -> None:
    plan = parse_plan(_plan(program, tmp_path), base_dir=tmp_path)
    m = plan.models["net"]
    assert m.network == str(tmp_path / "skipnet.pt2") and m.input_shape == [3, 32, 32] and m.num_classes == 10
    assert plan.blocks["front"].weights.seed is None and plan.blocks["front"].weights.file is None  # the program's own
    assert plan.block_in_shapes(plan.blocks["middle"]) == ((16, 32, 32), (32, 16, 16))


@pytest.mark.parametrize(("change", "loc", "fragment"), [
    ({"models": {"net": {"program": "missing.pt2", "cut_points": ["down"]}}}, "models.net.program", "file not found"),
    ({"models": {"net": {"program": "../outside/skipnet.pt2", "cut_points": ["down"]}}}, "models.net.program",
     "outside the directories"),
    ({"models": {"net": {"program": "skipnet.onnx"}}}, "models.net.program", "is not a .pt2 file"),
    ({"models": {"net": {"program": "skipnet.pt2", "arch": "resnet18"}}}, "models.net", "exactly one of arch"),
    ({"models": {"net": {"program": "skipnet.pt2", "input_shape": [3, 64, 64]}}}, "models.net",
     "come(s) from the exported program"),
    ({"models": {"net": {"program": "skipnet.pt2", "cut_points": ["down", "bodi"]}}}, "models.net.cut_points[1]",
     "did you mean 'body'"),
    ({"blocks": {"front": {"model": "net", "stages": 0, "weights": {"seed": 1}}}}, "blocks.front.weights.seed",
     "exported program with its own weights"),
])
def test_bad_program_plans_name_key_and_fix(program: Path, tmp_path: Path, change: dict[str, Any], loc: str,
                                            fragment: str) -> None:
    here = tmp_path / "plans"
    here.mkdir()
    data = _plan(program, here)
    for section, entries in change.items():
        data[section].update(entries)
    with pytest.raises(PlanError) as err:
        plan = parse_plan(data, base_dir=here, weights_dirs=[here])
        raise AssertionError(f"accepted: {plan.models}")
    assert any(i.loc == loc and fragment in i.message for i in err.value.issues), err.value.issues


def test_a_stage_of_a_program_can_be_kept_by_the_stage_cache(program: Path, tmp_path: Path) -> None:
    # The stage cache pickles built parts; an exported program's own module cannot be pickled, a stage can.
    net = arch.build_network(str(program), 0, 0)
    stage = arch.slice_stages(net, str(program), ["down", "body"], 1, 2)
    torch.save(stage, tmp_path / "stage.pt")
    kept = torch.load(tmp_path / "stage.pt", weights_only=False)
    xs = (torch.randn(2, 16, 32, 32), torch.randn(2, 32, 16, 16))
    with torch.no_grad():
        assert torch.equal(kept(*xs), stage(*xs))


@pytest.fixture(scope="module")
def stage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("stages")
    import subprocess
    import sys

    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_example_model.py"), str(directory / "skipnet.pt2"),
                    "--blocks", str(directory / "blocks")], check=True, capture_output=True)
    shutil.copy(ROOT / "plans" / "examples" / "skipnet_stages.yaml", directory)
    return directory


def test_stage_files_chained_equal_the_program(stage_dir: Path) -> None:
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = torch.export.load(stage_dir / "skipnet.pt2").module()(x)
        for suffix in ("pt2", "ts"):
            xs: tuple[torch.Tensor, ...] = (x,)
            for i in range(3):
                out = stage_files.load_stage_file(str(stage_dir / "blocks" / f"stage{i}.{suffix}"))(*xs)
                xs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            assert torch.allclose(xs[0], want, rtol=0, atol=1e-6), suffix
    plan = parse_plan(yaml.safe_load((stage_dir / "skipnet_stages.yaml").read_text()), base_dir=stage_dir)
    for name in ("exported", "scripted"):
        assert plan.models[name].input_shape == [3, 32, 32] and plan.models[name].num_classes == 10
        assert plan.stage_shapes[name] == [((32, 16, 16), (16, 32, 32)), ((32, 16, 16), (16, 32, 32)), ((10,),)]


@pytest.mark.parametrize(("model", "loc", "fragment"), [
    ({"stage_files": ["blocks/stage0.pt2", "blocks/stage0.pt2"]}, "models.exported.stage_files[1]",
     "takes [3, 32, 32] but blocks/stage0.pt2 gives [32, 16, 16] + [16, 32, 32]"),
    ({"stage_files": ["blocks/stage1.pt2", "blocks/stage2.pt2"]}, "models.exported.stage_files[0]", "it must take one"),
    ({"stage_files": ["blocks/stage0.pt2", "blocks/stage1.pt2"]}, "models.exported.stage_files[1]", "it must give one"),
    ({"stage_files": ["blocks/stage0.ts", "blocks/stage1.ts", "blocks/stage2.ts"]}, "models.exported.stage_files",
     "does not record its input's shape; give the model's input_shape"),
    ({"stage_files": ["blocks/stage0.pt2", "blocks/stage1.pt2", "blocks/stage2.pt2"], "input_shape": [3, 64, 64]},
     "models.exported.input_shape", "takes [3, 32, 32]"),
    ({"stage_files": ["blocks/stage0.pt2", "blocks/stage1.pt2", "blocks/stage2.pt2"], "cut_points": ["x"]},
     "models.exported", "come(s) from the stage files"),
    ({"stage_files": ["blocks/stage0.pt2", "blocks/nothing.pt2"]}, "models.exported.stage_files[1]", "file not found"),
])
def test_bad_stage_files_name_key_and_fix(stage_dir: Path, model: dict[str, Any], loc: str, fragment: str) -> None:
    data: dict[str, Any] = yaml.safe_load((stage_dir / "skipnet_stages.yaml").read_text())
    data["models"]["exported"] = model
    data["blocks"] = {"whole": {"model": "exported", "stages": [0, len(model["stage_files"]) - 1]},
                      "ts": {"model": "scripted", "stages": [0, 2]}}
    data["tasks"] = {"task_a": {"path": ["whole"]}, "task_b": {"path": ["ts"]}}
    with pytest.raises(PlanError) as err:
        parse_plan(data, base_dir=stage_dir)
    assert any(i.loc == loc and fragment in i.message for i in err.value.issues), err.value.issues


def test_stage_file_blocks_take_no_weights(stage_dir: Path) -> None:
    data: dict[str, Any] = yaml.safe_load((stage_dir / "skipnet_stages.yaml").read_text())
    data["blocks"]["front"]["weights"] = {"seed": 1}
    with pytest.raises(PlanError, match="carry their own weights"):
        parse_plan(data, base_dir=stage_dir)


def test_a_torchscript_file_convolves_without_the_tf32_it_was_traced_with(tmp_path: Path) -> None:
    # torch.jit.trace records cuDNN's allow_tf32 (True by default) in every convolution; left so,
    # a fp32 block of a TorchScript file would convolve in TF32 on a GPU (1.2e-4 off, measured).
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    torch.jit.save(torch.jit.trace(net, torch.randn(1, 3, 8, 8)), tmp_path / "s.ts")  # type: ignore[no-untyped-call]

    def allow_tf32(module: nn.Module) -> list[bool]:
        return [n.inputsAt(12).toIValue() for m in module.modules() if hasattr(m, "forward") and hasattr(m.forward, "graph")
                for n in m.forward.graph.findAllNodes("aten::_convolution")]

    assert allow_tf32(torch.jit.load(tmp_path / "s.ts")) == [True, True]  # type: ignore[no-untyped-call]  # as traced
    loaded = stage_files.load_stage_file(str(tmp_path / "s.ts"))
    assert allow_tf32(loaded) == [False, False]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), net(x))
