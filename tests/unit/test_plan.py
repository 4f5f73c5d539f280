"""Plan validation: every mistake names its key path and the fix."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from blockflow.core.errors import PlanError
from blockflow.plan import load_plan, parse_plan

ROOT = Path(__file__).resolve().parents[2]


def base() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "plans" / "default.yaml").read_text())
    return data


def test_default_plan_is_valid_and_resolved() -> None:
    plan = load_plan(ROOT / "plans" / "default.yaml")
    assert set(plan.tasks) == {"cls_a", "cls_b", "det_c", "full_d"}
    assert plan.stage_shapes["r50"] == [((256, 56, 56),), ((512, 28, 28),), ((1024, 14, 14),), ((1000,),)]
    sharing = plan.sharing()
    assert sharing["r50_s0"] == ["cls_a", "cls_b", "det_c"]
    assert sharing["r50_s2"] == ["cls_a", "cls_b"]
    assert sharing["r50_full_d"] == ["full_d"]
    b = plan.blocks["r50_s0"]
    assert (b.first, b.last, b.instances, b.max_batch_size, b.precision) == (0, 0, 1, 8, "fp32")
    assert plan.warnings() == []


def test_block_settings_override_defaults_then_builtins() -> None:
    data = base()
    data["defaults"] = {"max_batch_size": 4}
    data["blocks"]["r50_s1"]["max_batch_size"] = 16
    plan = parse_plan(data)
    assert plan.blocks["r50_s0"].max_batch_size == 4
    assert plan.blocks["r50_s1"].max_batch_size == 16
    assert plan.blocks["r50_s0"].batching_delay_us == 100  # built-in default


def test_unused_block_is_a_warning() -> None:
    data = base()
    data["blocks"]["spare"] = {"model": "r50", "stages": 3}
    assert parse_plan(data).warnings() == ["blocks.spare: no task uses this block; it is not deployed"]


def test_reference_instances_without_references_is_a_warning() -> None:
    data = base()
    data["reference_instances"] = 4
    data["references"] = []
    assert parse_plan(data).warnings() == ["reference_instances has no effect without references"]
    data["references"] = ["graph"]
    assert parse_plan(data).warnings() == []


def test_dynamic_batching_off_drops_the_batcher_and_warns_on_a_shared_block() -> None:
    from blockflow.ensemble_gen import generator

    data = base()
    data["blocks"]["r50_s0"]["dynamic_batching"] = False
    data["blocks"]["r50_full_d"]["dynamic_batching"] = False
    plan = parse_plan(data)
    assert plan.warnings() == ["blocks.r50_s0: dynamic_batching is off, so requests of its 3 tasks (cls_a, cls_b, det_c) "
                               "never share an execute; under load it runs them one by one"]
    models = generator.by_model(generator.render(plan))
    assert b"dynamic_batching" not in models["r50_s0"]["config.pbtxt"]
    assert b"dynamic_batching {\n  max_queue_delay_microseconds: 100\n}" in models["r50_s1"]["config.pbtxt"]
    with pytest.raises(PlanError, match="dynamic_batching"):
        parse_plan(base() | {"defaults": {"dynamic_batching": "sometimes"}})


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return apply


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for p in parents:
            node = node[p]
        del node[last]
    return apply


# (id, mutation, key path expected in the message, fragment of the message)
INVALID: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("unknown-top-key", _set("transprot", "tensormq"), "transprot", "did you mean 'transport'"),
    ("unknown-block-key", _set("blocks.r50_s0.instance", 2), "blocks.r50_s0.instance", "did you mean 'instances'"),
    ("unknown-model-key", _set("models.r50.cuts", ["layer1"]), "models.r50.cuts", "allowed keys"),
    ("bad-version", _set("version", 2), "version", "not allowed; use 1"),
    ("missing-version", _delete("version"), "version", "required key is missing"),
    ("missing-tasks", _delete("tasks"), "tasks", "required key is missing"),
    ("unknown-arch", _set("models.r50.arch", "resnet51"), "models.r50.arch", "unknown architecture 'resnet51'"),
    ("bad-cut-name", _set("models.r50.cut_points", ["layer1", "layr2", "layer3"]), "models.r50.cut_points[1]", "did you mean 'layer2'"),
    ("cut-after-last", _set("models.r50.cut_points", ["layer1", "layer2", "fc"]), "models.r50.cut_points[2]", "'fc' is not a place where resnet50 can be cut"),
    ("cuts-out-of-order", _set("models.r50.cut_points", ["layer2", "layer1", "layer3"]), "models.r50.cut_points[1]", "does not come after 'layer2'"),
    ("input-shape-channels", _set("models.r50.input_shape", [1, 224, 224]), "models.r50.input_shape", "is not [3, H, W]"),
    ("input-shape-length", _set("models.r50.input_shape", [3, 224]), "models.r50.input_shape", "input_shape"),
    ("num-classes-zero", _set("models.r50.num_classes", 0), "models.r50.num_classes", "greater than or equal to 1"),
    ("block-unknown-model", _set("blocks.r50_s1.model", "r51"), "blocks.r50_s1.model", "unknown model 'r51'"),
    ("stage-out-of-range", _set("blocks.r50_s3a.stages", 4), "blocks.r50_s3a.stages", "within 0..3"),
    ("stage-range-reversed", _set("blocks.r50_full_d.stages", [3, 0]), "blocks.r50_full_d.stages", "within 0..3"),
    ("instances-zero", _set("blocks.r50_s0.instances", 0), "blocks.r50_s0.instances", "greater than or equal to 1"),
    ("batch-too-big", _set("defaults.max_batch_size", 5000), "defaults.max_batch_size", "less than or equal to 1024"),
    ("bad-precision", _set("blocks.r50_s0.precision", "fp8"), "blocks.r50_s0.precision", "'fp8' is not allowed"),
    ("bad-transport", _set("transport", "nccl"), "transport", "'nccl' is not allowed"),
    ("bad-task-transport", _set("tasks.cls_a.transport", "zmq"), "tasks.cls_a.transport", "'zmq' is not allowed"),
    ("bad-placement", _set("blocks.r50_s0.placement", "tpu"), "blocks.r50_s0.placement", "placement"),
    ("empty-gpu-list", _set("blocks.r50_s0.placement", []), "blocks.r50_s0.placement", "empty GPU list"),
    ("duplicate-gpus", _set("blocks.r50_s0.placement", [0, 0]), "blocks.r50_s0.placement", "distinct GPU indices"),
    ("weights-both", _set("blocks.r50_s0.weights", {"seed": 1, "file": "w.pt"}), "blocks.r50_s0.weights", "not seed and file"),
    ("weights-none", _set("blocks.r50_s0.weights", {}), "blocks.r50_s0.weights", "exactly one of seed, file or torchvision"),
    ("weights-missing-file", _set("blocks.r50_s0.weights", {"file": "nope.pt"}), "blocks.r50_s0.weights.file", "file not found"),
    ("path-unknown-block", _set("tasks.cls_a.path.3", "r50_s3x"), "tasks.cls_a.path[3]", "unknown block 'r50_s3x'"),
    ("path-skips-stage", _set("tasks.cls_b.path.2", "r50_s3b"), "tasks.cls_b.path[2]", "covers stage 3 but stage 2 is expected here"),
    ("path-not-from-zero", _set("tasks.cls_a.path", ["r50_s1", "r50_s2", "r50_s3a"]), "tasks.cls_a.path[0]", "stage 0 is expected"),
    ("path-too-short", _set("tasks.cls_a.path", ["r50_s0", "r50_s1", "r50_s2"]), "tasks.cls_a.path", "add blocks up to stage 3"),
    ("path-empty", _set("tasks.cls_a.path", []), "tasks.cls_a.path", "at least 1 item"),
    ("bad-task-name", lambda d: d["tasks"].__setitem__("bad name", d["tasks"]["cls_a"]), "tasks.bad name", "invalid name"),
    ("reserved-separator", lambda d: d["tasks"].__setitem__("cls__x", d["tasks"]["cls_a"]), "tasks.cls__x", "no '__'"),
    ("task-block-clash", lambda d: d["tasks"].__setitem__("r50_s0", d["tasks"]["cls_a"]), "tasks.r50_s0", "also a block name"),
    ("bad-reference", _set("references", ["lazy"]), "references[0]", "'lazy' is not allowed"),
    ("string-batch", _set("blocks.r50_s0.max_batch_size", "eight"), "blocks.r50_s0.max_batch_size", "valid integer"),
]


@pytest.mark.parametrize(("mutate", "loc", "fragment"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_plan_names_key_and_fix(mutate: Callable[[dict[str, Any]], None], loc: str, fragment: str, tmp_path: Path) -> None:
    data = copy.deepcopy(base())
    mutate(data)
    with pytest.raises(PlanError) as info:
        parse_plan(data, base_dir=tmp_path)
    locs = [i.loc for i in info.value.issues]
    assert loc in locs, f"expected {loc!r} among {locs}: {info.value}"
    message = str(next(i for i in info.value.issues if i.loc == loc))
    assert fragment in message, message


def test_mismatched_shapes_between_models(tmp_path: Path) -> None:
    data = base()
    data["models"]["r18"] = {"arch": "resnet18", "cut_points": ["layer1", "layer2", "layer3"]}
    data["blocks"]["r18_s3"] = {"model": "r18", "stages": 3}
    data["tasks"]["mixed"] = {"path": ["r50_s0", "r50_s1", "r50_s2", "r18_s3"]}
    with pytest.raises(PlanError) as info:
        parse_plan(data)
    msg = str(info.value)
    assert "tasks.mixed.path[3]" in msg and "takes [256, 14, 14] but 'r50_s2' (model 'r50') gives [1024, 14, 14]" in msg


def test_all_problems_reported_at_once() -> None:
    data = base()
    data["blocks"]["r50_s0"]["instances"] = 0
    data["blocks"]["r50_s1"]["precision"] = "fp64"
    with pytest.raises(PlanError) as info:
        parse_plan(data)
    assert len(info.value.issues) == 2


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="plan file not found"):
        load_plan(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodels: [unclosed\n")
    with pytest.raises(PlanError, match="not valid YAML/JSON at line"):
        load_plan(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(PlanError, match="a plan is a mapping"):
        load_plan(scalar)


def test_json_plans_and_relative_weight_files(tmp_path: Path) -> None:
    import json

    import torch

    data = base()
    torch.save({}, tmp_path / "w.pt")
    data["blocks"]["r50_s0"]["weights"] = {"file": "w.pt"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert plan.blocks["r50_s0"].weights.file == str(tmp_path / "w.pt")
    assert plan.blocks["r50_s0"].weights.seed is None


def test_placement_is_checked_against_the_machine() -> None:
    data = base()
    data["blocks"]["r50_s1"]["placement"] = [1]
    data["blocks"]["r50_s2"]["placement"] = "gpu"
    plan = parse_plan(data)
    cpu_only = {i.loc: i.message for i in plan.device_issues(gpus=0)}
    assert "GPU 1 does not exist (this machine has no GPU)" in cpu_only["blocks.r50_s1.placement"]
    assert "'gpu' but this machine has no GPU" in cpu_only["blocks.r50_s2.placement"]
    assert [i.loc for i in plan.device_issues(gpus=1)] == ["blocks.r50_s1.placement"]
    assert plan.device_issues(gpus=2) == []


def test_a_path_across_models_is_accepted_where_the_shapes_match() -> None:
    # ResNet-101's layer3 gives what ResNet-50's does: a path may go on from one model's block to another's.
    data = base()
    data["models"]["r101"] = {"arch": "resnet101", "cut_points": ["layer1", "layer2", "layer3"]}
    data["blocks"]["r101_s3"] = {"model": "r101", "stages": 3}
    data["tasks"]["mixed"] = {"path": ["r50_s0", "r50_s1", "r50_s2", "r101_s3"]}
    assert parse_plan(data).block_out_shape(parse_plan(data).blocks["r101_s3"]) == (1000,)
    data["models"]["r101"]["cut_points"] = ["layer1", "layer2", "layer4.0"]
    with pytest.raises(PlanError) as info:
        parse_plan(data)
    assert "tasks.mixed.path[3]: block 'r101_s3' (model 'r101') takes" in str(info.value)


def test_a_block_fed_in_two_dtypes_is_refused() -> None:
    # A hop crosses in the precision of the block before it; one Triton model has one input dtype.
    data = base()
    data["blocks"]["alt_s0"] = {"model": "r50", "stages": 0, "precision": "fp16", "weights": {"seed": 1}}
    data["tasks"]["alt"] = {"path": ["alt_s0", *data["tasks"]["cls_a"]["path"][1:]]}
    with pytest.raises(PlanError) as info:
        parse_plan(data)
    [issue] = info.value.issues
    assert issue.loc == "blocks.r50_s1" and "'alt_s0' (fp16), 'r50_s0' (fp32)" in issue.message
    data["blocks"]["alt_s0"]["precision"] = "tf32"  # tf32 computes in fp32 and hands on fp32
    assert parse_plan(data).block_in_dtype(parse_plan(data).blocks["r50_s1"]) == "fp32"
