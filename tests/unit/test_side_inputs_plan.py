"""Side inputs in plans and generated repositories: which blocks, fused models, references and task
ensembles take them, and what the plan refuses or leaves unpacked (``tests/side_programs.py``'s programs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.core.errors import PlanError
from blockflow.core.spec import SPEC_PARAMETER, ModelSpec, SideInput
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt
from blockflow.plan import Plan, direct_pairs, parse_plan
from tests import side_programs

SIZE = SideInput(name="size", dtype="int64", shape=(2,))
SCALE = SideInput(name="scale", dtype="fp32", shape=(1,))


class ScaledBySize(side_programs.Scaled):
    """``Scaled`` whose side input is called ``size`` (fp32 [B, 1]: not what SizedBoxes' ``size`` is)."""

    def forward(self, image: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
        return super().forward(image, size)


class ScaledByArea(side_programs.Scaled):
    """``Scaled`` whose side input is called ``area``, as one of SizedBoxes' outputs is."""

    def forward(self, image: torch.Tensor, area: torch.Tensor) -> torch.Tensor:
        return super().forward(image, area)


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("side_programs")
    side_programs.sized_boxes(where)
    side_programs.scaled(where)
    side_programs.export(ScaledBySize(), torch.rand(2, 1), where / "by_size.pt2")
    side_programs.export(ScaledByArea(), torch.rand(2, 1), where / "by_area.pt2")
    return where


def _data(**top: Any) -> dict[str, Any]:
    """Two programs, each cut in two (SizedBoxes after ``stem``, Scaled after ``body``; both hand on
    [8, 16, 16] there); task ``sized`` (only its last block reads ``size``) and task ``scaled`` (both
    read ``scale``)."""
    data: dict[str, Any] = {
        "version": 1,
        "name": "side",
        "models": {"boxes": {"program": "sized_boxes.pt2", "cut_points": ["stem"]},
                   "scaled": {"program": "scaled.pt2", "cut_points": ["body"]}},
        "defaults": {"placement": "cpu", "max_batch_size": 4},
        "blocks": {"b0": {"model": "boxes", "stages": 0}, "b1": {"model": "boxes", "stages": 1},
                   "s0": {"model": "scaled", "stages": 0}, "s1": {"model": "scaled", "stages": 1}},
        "tasks": {"sized": {"path": ["b0", "b1"]}, "scaled": {"path": ["s0", "s1"]}},
    }
    data.update(top)
    return data


def _plan(programs: Path, data: dict[str, Any]) -> Plan:
    return parse_plan(data, base_dir=programs)


def _configs(plan: Plan) -> dict[str, mc.ModelConfig]:
    files = generator.render(plan)
    return {p.split("/")[0]: parse_pbtxt(d.decode()) for p, d in files.items() if p.endswith("config.pbtxt")}


def _inputs(cfg: mc.ModelConfig) -> list[tuple[str, int, list[int]]]:
    return [(i.name, i.data_type, list(i.dims)) for i in cfg.input]


def _spec(cfg: mc.ModelConfig) -> ModelSpec:
    return ModelSpec.model_validate(json.loads(cfg.parameters[SPEC_PARAMETER].string_value))


def _maps(cfg: mc.ModelConfig) -> dict[str, dict[str, str]]:
    """Each step's model -> its input map."""
    return {s.model_name: dict(s.input_map) for s in cfg.ensemble_scheduling.step}


TICKET = ("ACTIVATION_IN", mc.TYPE_UINT8, [256])


def test_blocks_take_the_side_inputs_they_read_after_their_hop(programs: Path) -> None:
    plan = _plan(programs, _data())
    assert plan.task_side_inputs(plan.tasks["sized"]) == (SIZE,)
    assert plan.task_side_inputs(plan.tasks["scaled"]) == (SCALE,)
    cfgs = _configs(plan)
    assert _inputs(cfgs["b0"]) == [("IMAGE", mc.TYPE_FP32, [3, 16, 16])]
    assert _inputs(cfgs["b1"]) == [TICKET, ("size", mc.TYPE_INT64, [2])]
    assert _inputs(cfgs["s0"]) == [("IMAGE", mc.TYPE_FP32, [3, 16, 16]), ("scale", mc.TYPE_FP32, [1])]
    assert _inputs(cfgs["s1"]) == [TICKET, ("scale", mc.TYPE_FP32, [1])]
    # The specs say which part reads which.
    assert _spec(cfgs["b0"]).side_inputs == () and _spec(cfgs["b0"]).parts[0].side_inputs == ()
    assert _spec(cfgs["b1"]).side_inputs == (SIZE,) and _spec(cfgs["b1"]).parts[0].side_inputs == ("size",)
    assert _spec(cfgs["s0"]).parts[0].side_inputs == ("scale",) and _spec(cfgs["s1"]).parts[0].side_inputs == ("scale",)


@pytest.mark.parametrize("transport", ["triton-gpu", "triton-cpu"])
def test_a_block_after_a_plain_hop_takes_its_side_inputs_after_the_hop_tensors(programs: Path, transport: str) -> None:
    cfgs = _configs(_plan(programs, _data(transport=transport)))
    b1 = next(cfg for name, cfg in cfgs.items() if name.startswith("b1"))
    assert [i.name for i in b1.input] == ["ACTIVATION_IN", "size"]
    assert b1.input[1].data_type == mc.TYPE_INT64


def test_each_task_ensemble_takes_its_side_inputs_and_gives_them_only_to_the_steps_that_read_them(programs: Path) -> None:
    cfgs = _configs(_plan(programs, _data()))
    sized, scaled = cfgs["sized"], cfgs["scaled"]
    assert _inputs(sized) == [("IMAGE", mc.TYPE_FP32, [3, 16, 16]), ("size", mc.TYPE_INT64, [2])]
    assert _inputs(scaled) == [("IMAGE", mc.TYPE_FP32, [3, 16, 16]), ("scale", mc.TYPE_FP32, [1])]
    maps = _maps(sized)
    assert "size" not in maps["b0"] and maps["b1"]["size"] == "size"
    assert all(m["scale"] == "scale" for m in _maps(scaled).values())
    # The task answers what the program returns.
    assert [o.name for o in sized.output] == ["boxes", "area"]


def test_fused_blocks_take_the_union_of_their_side_inputs(programs: Path) -> None:
    cfgs = _configs(_plan(programs, _data(fuse="auto")))
    fused, both = cfgs["b0__to__b1"], cfgs["s0__to__s1"]
    assert _inputs(fused) == [("IMAGE", mc.TYPE_FP32, [3, 16, 16]), ("size", mc.TYPE_INT64, [2])]
    spec = _spec(fused)
    assert spec.side_inputs == (SIZE,) and [p.side_inputs for p in spec.parts] == [(), ("size",)]
    assert [p.side_inputs for p in _spec(both).parts] == [("scale",), ("scale",)]
    assert _maps(cfgs["sized"])["b0__to__b1"]["size"] == "size"


def test_references_take_the_side_inputs_of_the_whole_path(programs: Path) -> None:
    cfgs = _configs(_plan(programs, _data(references=["eager"])))
    ref = cfgs["sized__ref"]
    assert _inputs(ref) == [("IMAGE", mc.TYPE_FP32, [3, 16, 16]), ("size", mc.TYPE_INT64, [2])]
    assert [p.side_inputs for p in _spec(ref).parts] == [(), ("size",)]


def test_a_path_across_models_takes_each_models_side_inputs(programs: Path) -> None:
    # Both programs hand on [8, 16, 16] after their stem: a path may go on from one to the other.
    data = _data(references=["eager"])
    data["tasks"] = {"mixed": {"path": ["s0", "b1"]}, "plain": {"path": ["b0", "s1"]}}
    plan = _plan(programs, data)
    assert plan.task_side_inputs(plan.tasks["mixed"]) == (SCALE, SIZE)
    cfgs = _configs(plan)
    assert _inputs(cfgs["mixed"])[1:] == [("scale", mc.TYPE_FP32, [1]), ("size", mc.TYPE_INT64, [2])]
    maps = _maps(cfgs["mixed"])
    assert set(maps["s0"]) == {"IMAGE", "scale"} and set(maps["b1"]) == {"ACTIVATION_IN", "size"}
    ref = _spec(cfgs["mixed__ref"])
    assert ref.side_inputs == (SCALE, SIZE)
    assert [(p.network is not None, p.side_inputs) for p in ref.parts] == [(True, ("scale",)), (False, ("size",))]
    assert _inputs(cfgs["plain__ref"])[1:] == [("scale", mc.TYPE_FP32, [1])]


def test_one_side_input_name_means_one_dtype_and_shape_along_a_path(programs: Path) -> None:
    data = _data()
    data["models"]["by_size"] = {"program": "by_size.pt2", "cut_points": ["body"]}
    data["blocks"]["z0"] = {"model": "by_size", "stages": 0}
    data["tasks"] = {"both": {"path": ["z0", "b1"]}}
    with pytest.raises(PlanError) as exc:
        _plan(programs, data)
    (issue,) = exc.value.issues
    assert issue.loc == "tasks.both.path"
    assert "'size' is fp32 [1] in model 'by_size' but int64 [2] in model 'boxes'" in issue.message


def test_a_side_input_named_like_an_output_of_its_task_is_refused(programs: Path) -> None:
    data = _data()
    data["models"]["by_area"] = {"program": "by_area.pt2", "cut_points": ["body"]}
    data["blocks"]["a0"] = {"model": "by_area", "stages": 0}
    data["tasks"] = {"clash": {"path": ["a0", "b1"]}}
    with pytest.raises(PlanError) as exc:
        _plan(programs, data)
    (issue,) = exc.value.issues
    assert issue.loc == "tasks.clash.path" and "side input 'area' is also the name of one of the task's outputs" in issue.message


def test_a_task_with_side_inputs_does_not_cross_servers(programs: Path) -> None:
    data = _data(servers={"edge": {"grpc": "127.0.0.1:8001"}, "cloud": {"grpc": "127.0.0.1:9001"}})
    data["blocks"]["b1"]["server"] = "cloud"
    data["tasks"] = {"sized": {"path": ["b0", "b1"], "transport": "triton-gpu"}}
    with pytest.raises(PlanError) as exc:
        _plan(programs, data)
    (issue,) = exc.value.issues
    assert issue.loc == "tasks.sized.path"
    assert "crosses servers (edge → cloud)" in issue.message and "'size'" in issue.message
    # On one server it is served.
    data["blocks"]["b1"]["server"] = "edge"
    assert "sized" in _configs(_plan(programs, data).on_server("edge"))


def test_heads_that_read_side_inputs_are_never_packed(programs: Path) -> None:
    data = _data(pack="heads")
    data["blocks"]["s1b"] = {"model": "scaled", "stages": 1}
    data["tasks"] = {"one": {"path": ["s0", "s1"]}, "two": {"path": ["s0", "s1b"]}}
    plan = _plan(programs, data)
    assert plan.head_packs == {}
    assert any("packs nothing" in w for w in plan.warnings())
    cfgs = _configs(plan)
    assert {"s1", "s1b"} <= set(cfgs) and not any(name.endswith("__heads") for name in cfgs)


def test_whole_models_that_read_side_inputs_are_never_packed(programs: Path) -> None:
    data = _data(pack="all")
    data["blocks"] = {"w1": {"model": "scaled", "stages": [0, 1]}, "w2": {"model": "scaled", "stages": [0, 1]}}
    data["tasks"] = {"one": {"path": ["w1"]}, "two": {"path": ["w2"]}}
    plan = _plan(programs, data)
    assert plan.head_packs == {}
    assert _inputs(_configs(plan)["w1"])[1:] == [("scale", mc.TYPE_FP32, [1])]


def test_a_model_that_reads_side_inputs_never_receives_a_direct_hand_over() -> None:
    paths = {"t": ["a", "b", "c", "d", "e"]}
    assert direct_pairs.pairs(paths) == {"b": "c", "c": "d"}
    assert direct_pairs.pairs(paths, readers={"c"}) == {"c": "d"}  # c may still hand on; it takes from the ensemble
    assert direct_pairs.pairs(paths, readers={"d"}) == {"b": "c"}


def test_a_block_that_reads_side_inputs_is_no_receiver_of_a_direct_hand_over(programs: Path) -> None:
    data = _data(hand_over="direct")
    # Scaled in four: the stem, its ReLU, the scaling and body (reads scale), the rest (reads scale).
    data["models"]["scaled"]["cut_points"] = ["stem", "relu", "body"]
    data["blocks"] = {f"c{i}": {"model": "scaled", "stages": i} for i in range(4)}
    data["tasks"] = {"long": {"path": ["c0", "c1", "c2", "c3"]}}
    plan = _plan(programs, data)
    assert [plan.block_side_inputs(plan.blocks[f"c{i}"]) for i in range(4)] == [(), (), ("scale",), ("scale",)]
    assert plan.hand_overs == {}  # c1 -> c2 would qualify, but c2 reads scale
    assert any("finds no pair" in w for w in plan.warnings())
    maps = _maps(_configs(plan)["long"])
    assert maps["c2"] == {"ACTIVATION_IN": "hop1_c1", "scale": "scale"}


def test_show_lists_each_tasks_inputs(programs: Path) -> None:
    from blockflow.cli import app

    (programs / "side.json").write_text(json.dumps(_data()))
    res = CliRunner().invoke(app, ["show", str(programs / "side.json"), "--json"])
    assert res.exit_code == 0, res.output
    tasks = {t["task"]: t for t in json.loads(res.output)["tasks"]}
    assert tasks["sized"]["inputs"] == [{"name": "IMAGE", "dtype": "float32", "shape": [3, 16, 16]},
                                        {"name": "size", "dtype": "int64", "shape": [2]}]
    assert tasks["scaled"]["inputs"][1] == {"name": "scale", "dtype": "float32", "shape": [1]}
    res = CliRunner().invoke(app, ["show", str(programs / "side.json")])
    assert res.exit_code == 0, res.output
    assert "IMAGE [3, 16, 16], size [2] int64" in res.output and "IMAGE [3, 16, 16], scale [1]" in res.output


def test_a_program_of_named_outputs_may_end_in_an_fp16_block(programs: Path) -> None:
    # Only a detector's last stages (its NMS) must run in fp32 or tf32; an exported program's outputs need not.
    data = _data()
    data["defaults"]["precision"] = "fp16"
    plan = _plan(programs, data)
    assert plan.blocks["b1"].precision == "fp16" and plan.block_outputs(plan.blocks["b1"])


def test_serve_suggests_commands_that_send_the_side_inputs(programs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from blockflow.cli import serve

    plan = _plan(programs, _data())
    server = SimpleNamespace(http_url="127.0.0.1:8000", grpc_url="127.0.0.1:8001")
    serve._print_tries(plan.tasks["sized"], plan, server)  # type: ignore[arg-type]
    printed = capsys.readouterr().out
    assert "blockflow infer sized --random --input size=size.npy --url 127.0.0.1:8000" in printed
    assert "side_input_data(Path('inputs'), (3, 16, 16), False" in printed and "-b 1 --input-data inputs" in printed
