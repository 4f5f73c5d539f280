"""Packs of whole models (``pack: all``) and ``pack_size``: which tasks are packed, the generated
configs, and the memory the model predicts for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.core.spec import ModelSpec
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt
from blockflow.plan import Plan, load_plan, memory, parse_plan

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "tests" / "plans" / "model_pack.yaml"


def _raw(path: Path = PLAN) -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    return raw


def _packs(plan: Plan) -> dict[str, str]:
    return {t: p.name for t, p in plan.head_packs.items()}


def _whole(n: int, **settings: Any) -> dict[str, Any]:
    """A plan of ``n`` tasks with whole ResNet-18s of their own (one block each)."""
    return {"version": 1, "models": {"r18": {"arch": "resnet18", "cut_points": ["layer2"], "input_shape": [3, 64, 64],
                                             "num_classes": 10}},
            "blocks": {f"w{i}": {"model": "r18", "stages": [0, 1], "weights": {"seed": i}} for i in range(n)},
            "tasks": {f"t{i}": {"path": [f"w{i}"]} for i in range(n)}, "pack": "all", **settings}


def test_pack_all_packs_whole_models_up_to_pack_size() -> None:
    plan = load_plan(PLAN)
    assert _packs(plan) == {"w_one": "w1__pack", "w_two": "w1__pack"}  # w_three: the third, alone
    pack = plan.head_packs["w_one"]
    assert pack.after == "" and [[b.name for b in h] for h in pack.heads] == [["w1"], ["w2"]]
    assert [u.name for u in plan.deployed(plan.tasks["w_one"])] == ["w1__pack"]
    assert [u.name for u in plan.deployed(plan.tasks["w_three"])] == ["w3"]
    assert plan.warnings() == []


@pytest.mark.parametrize(("n", "size", "sizes"), [(2, 8, [2]), (8, 8, [8]), (9, 8, [5, 4]), (5, 2, [2, 2]), (17, 8, [6, 6, 5])])
def test_a_group_is_split_into_packs_of_at_most_pack_size(n: int, size: int, sizes: list[int]) -> None:
    plan = parse_plan(_whole(n, pack_size=size))
    packs: dict[str, list[str]] = {}
    for task, pack in plan.head_packs.items():
        packs.setdefault(pack.name, []).append(task)
    assert sorted((len(ts) for ts in packs.values()), reverse=True) == sizes  # n = 5: the fifth stays alone
    assert all(list(p.tasks) == packs[p.name] for p in plan.head_packs.values())


def test_pack_size_splits_head_packs_too() -> None:
    raw = _raw(ROOT / "tests" / "plans" / "packed.yaml")
    for i in (5, 6, 7):
        raw["blocks"][f"h{i}"] = {"model": "r18", "stages": 3, "weights": {"seed": 40 + i}}
        raw["tasks"][f"p_{i}"] = {"path": ["ptrunk0", "ptrunk1", "pmid", f"h{i}"], "transport": "triton-cpu"}
    raw["pack_size"] = 2
    packs = _packs(parse_plan(raw, base_dir=ROOT / "tests" / "plans"))
    # pmid's five heads: 2 + 2 + 1 (alone); the trunk's two heads: one pack
    assert packs == {"p_one": "ptrunk0__to__ptrunk1__heads", "p_two": "ptrunk0__to__ptrunk1__heads",
                     "p_three": "pmid__heads", "p_four": "pmid__heads", "p_5": "pmid__heads2", "p_6": "pmid__heads2"}


@pytest.mark.parametrize("change", ["shared", "settings", "transport", "model", "unfused", "heads"])
def test_what_is_no_whole_model_of_its_own_stays_alone(change: str) -> None:
    raw = _whole(2)
    if change == "shared":  # a block another task also uses: the pair's tasks share w0
        raw["tasks"]["t1"]["path"] = ["w0"]
    elif change == "settings":
        raw["blocks"]["w1"]["precision"] = "fp16"
    elif change == "transport":
        raw["tasks"]["t1"]["transport"] = "triton-cpu"
    elif change == "model":  # the same network, but another model of the plan
        raw["models"]["other"] = raw["models"]["r18"]
        raw["blocks"]["w1"]["model"] = "other"
    elif change == "unfused":  # two deployed models each: no whole model in one, and no head shares a trunk
        for i in range(2):
            raw["blocks"][f"w{i}"]["stages"] = 0
            raw["blocks"][f"x{i}"] = {"model": "r18", "stages": 1, "weights": {"seed": i}}
            raw["tasks"][f"t{i}"]["path"] = [f"w{i}", f"x{i}"]
    else:
        raw["pack"] = "heads"
    plan = parse_plan(raw)
    assert plan.head_packs == {}
    if change != "heads":
        assert any("pack: 'all' packs nothing" in w for w in plan.warnings())
    assert parse_plan({**raw, "fuse": "auto"}).head_packs == {} or change == "unfused"


def test_pack_size_is_bounded_and_idle_without_pack() -> None:
    from blockflow.core.errors import PlanError

    for size in (1, 65):
        with pytest.raises(PlanError, match="pack_size"):
            parse_plan(_whole(2, pack_size=size))
    assert any("pack_size has no effect" in w for w in parse_plan(_whole(2, pack="none", pack_size=4)).warnings())


def _uint8_plan() -> Plan:
    """Two tasks on triton-cpu taking uint8 HWC images, u0's whole model two blocks (fused)."""
    raw = _whole(2, fuse="auto", transport="triton-cpu", references=["eager"])
    raw["models"]["r18"]["input"] = {"dtype": "uint8", "layout": "HWC"}
    raw["blocks"]["w0"]["stages"] = 0
    raw["blocks"]["x0"] = {"model": "r18", "stages": 1, "weights": {"seed": 0}}
    raw["tasks"]["t0"]["path"] = ["w0", "x0"]
    raw["tasks"]["t0"]["transport"] = raw["tasks"]["t1"]["transport"] = "triton-cpu"
    return parse_plan(raw)


def test_a_pack_of_whole_models_takes_the_image_and_each_ensemble_is_one_step() -> None:
    files = {**generator.render(parse_plan({**_raw(), "references": ["eager"]})), **generator.render(_uint8_plan())}
    names = generator.model_names(files)
    assert "w1" not in names and "w2" not in names and "w3" in names and "w1__triton_cpu" not in names
    for pack, dtype, dims, tasks in (("w1__pack", mc.TYPE_FP32, [3, 64, 64], ("w_one", "w_two")),
                                     ("w0__to__x0__pack", mc.TYPE_UINT8, [64, 64, 3], ("t0", "t1"))):
        cfg = parse_pbtxt(files[f"{pack}/config.pbtxt"].decode())
        assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [("IMAGE", dtype, dims)]
        assert [o.name for o in cfg.output] == [f"LOGITS__{t}" for t in tasks]
        spec = ModelSpec.model_validate_json(cfg.parameters["blockflow.spec"].string_value)
        assert spec.kind == "pack" and spec.takes_image and [h.task for h in spec.heads] == list(tasks)
        assert (spec.image is not None) == (dtype == mc.TYPE_UINT8)
        for task in tasks:
            ens = parse_pbtxt(files[f"{task}/config.pbtxt"].decode())
            [step] = ens.ensemble_scheduling.step
            assert step.model_name == pack and dict(step.input_map) == {"IMAGE": "IMAGE"}
            assert dict(step.output_map) == {f"LOGITS__{task}": "LOGITS"}
            assert ens.input[0].data_type == cfg.input[0].data_type and list(ens.input[0].dims) == dims
            ref = ModelSpec.model_validate_json(parse_pbtxt(files[f"{task}__ref/config.pbtxt"].decode())
                                                .parameters["blockflow.spec"].string_value)
            assert ref.kind == "reference" and not ref.heads and ref.image == spec.image  # the task's own, as unpacked
    t0 = ModelSpec.model_validate_json(parse_pbtxt(files["w0__to__x0__pack/config.pbtxt"].decode())
                                       .parameters["blockflow.spec"].string_value).heads[0]
    assert [p.block for p in t0.parts] == ["w0", "x0"]  # a fused whole model: one head of two parts


def test_a_pack_of_encoded_images_takes_ragged_files() -> None:
    raw = _whole(2)
    raw["models"]["r18"]["input"] = {"dtype": "encoded"}
    files = generator.render(parse_plan(raw))
    cfg = parse_pbtxt(files["w0__pack/config.pbtxt"].decode())
    [image] = cfg.input
    assert image.name == "IMAGE" and list(image.dims) == [-1] and image.allow_ragged_batch
    assert cfg.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "yes"


def test_memory_of_a_pack_of_whole_models() -> None:
    plan = load_plan(PLAN)
    raw = _raw()
    raw["pack"] = "none"
    unpacked = parse_plan(raw, base_dir=PLAN.parent)
    cal = memory.Calibration()
    procs = {p.model: p for p in memory.modular(plan, 1, cal)}
    assert sorted(procs) == ["w1__pack", "w3"]
    alone = {p.model: p for p in memory.modular(unpacked, 1, cal)}
    pack = procs["w1__pack"]
    assert pack.weights_mib == alone["w1"].weights_mib + alone["w2"].weights_mib  # weights per member
    assert pack.overhead_mib == cal.process_mib and pack.pool_mib == 0  # the overhead once, no TensorMQ pool
    # graphs: one full pool for the largest member, a share for the other (members of one network: equal)
    assert abs(pack.activations_mib - alone["w1"].activations_mib * (1 + cal.pack_head_factor / cal.activation_factor)) < 1e-9


@pytest.mark.parametrize("gpu", ["h100", "h200"])
@pytest.mark.parametrize("arch", ["resnet50", "resnet152"])
def test_fused_and_packed_saves_30_percent_in_every_scenario(arch: str, gpu: str) -> None:
    cal = memory.Calibration.load(memory.shipped_calibration(gpu))
    assert gpu.upper() in cal.source
    rows = memory.scenario_table(arch, 100, cal)
    assert len(rows) == 8 and all(r["saving_packed"] >= 0.30 for r in rows), [round(r["saving_packed"], 3) for r in rows]
    # scenario 8 (90% class A): 90 whole models in packs of at most 8, the heads of B and C in one pack each
    eight = memory.scenario_plan(arch, 100, memory.SCENARIOS[8], pack=True)
    assert eight.raw.pack == "all" and eight.raw.pack_size == memory.PACK_SIZE
    a_packs = {p.name: len(p.tasks) for t, p in eight.head_packs.items() if t.startswith("task_a")}
    assert len(a_packs) == 12 and max(a_packs.values()) <= memory.PACK_SIZE and sum(a_packs.values()) == 90


def test_the_calibration_follows_the_gpus_name() -> None:
    assert memory.shipped_calibration("NVIDIA H200").name == "h200.json"
    assert memory.shipped_calibration("NVIDIA H100 80GB HBM3").name == "h100.json"
    assert memory.shipped_calibration("NVIDIA A100-SXM4-80GB").name == "h100.json"  # the default
    assert memory.shipped_calibration("NVIDIA GH200 480GB").name == "h100.json"  # not an H200
    assert memory.shipped_calibration(None).name == "h100.json"
    assert all(memory.shipped_calibration(k).is_file() for k in memory.SHIPPED)
