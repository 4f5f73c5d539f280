"""The generator: golden repositories, protobuf round trips, determinism, atomic writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from blockflow.core.errors import GenerateError
from blockflow.core.spec import BRIDGE_PARAMETER, SPEC_PARAMETER, BridgeSpec, ModelSpec
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt, to_pbtxt
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
PLANS = [ROOT / "plans" / "default.yaml", *sorted((ROOT / "tests" / "plans").glob("*.yaml"))]
# Every plan BlockFlow ships, but the examples cut from an exported program, which need it exported first
# (tests/unit/test_program.py renders them).
SHIPPED = sorted(p for p in [*(ROOT / "plans").glob("*.yaml"), *(ROOT / "plans" / "examples").glob("*.yaml")]
                 if not p.stem.startswith("skipnet") and p not in PLANS)
GOLDEN = ROOT / "tests" / "golden"


def golden_dir(plan: Path) -> Path:
    return ROOT / "model_repository" if plan.parent == ROOT / "plans" else GOLDEN / plan.stem


@pytest.mark.parametrize("plan", PLANS, ids=[p.stem for p in PLANS])
def test_matches_golden_repository(plan: Path) -> None:
    """model_repository/ (default plan) and tests/golden/* are exactly what the generator gives.

    After an intended change: ./scripts/regenerate.sh
    """
    files = generator.render(load_plan(plan))
    assert generator.diff(files, golden_dir(plan)) == [], f"stale golden for {plan.name}; run ./scripts/regenerate.sh"


@pytest.mark.parametrize("plan", PLANS + SHIPPED, ids=[p.relative_to(ROOT).as_posix() for p in PLANS + SHIPPED])
def test_every_config_round_trips_through_protobuf(plan: Path) -> None:
    loaded = load_plan(plan)
    for server in loaded.raw.servers or [None]:  # a plan over several servers: each server's repository
        files = generator.render(loaded.on_server(server))
        configs = {p: d.decode() for p, d in files.items() if p.endswith("config.pbtxt")}
        assert configs
        for path, text in configs.items():
            cfg = parse_pbtxt(text)
            assert to_pbtxt(cfg) == text
            assert cfg.name == path.split("/")[0]
            if cfg.platform == "ensemble":
                steps = [s.model_name for s in cfg.ensemble_scheduling.step]
                assert all(f"{s}/config.pbtxt" in files for s in steps), steps
            elif BRIDGE_PARAMETER in cfg.parameters:  # a task's crossing to the next server
                assert cfg.backend == "python"
                BridgeSpec.model_validate_json(cfg.parameters[BRIDGE_PARAMETER].string_value)
            else:
                assert cfg.backend == "python"
                spec = ModelSpec.model_validate(json.loads(cfg.parameters[SPEC_PARAMETER].string_value))
                assert spec.max_batch_size == cfg.max_batch_size


def test_default_plan_models_and_naming() -> None:
    plan = load_plan(ROOT / "plans" / "default.yaml")
    names = generator.model_names(generator.render(plan))
    assert names == sorted([
        "cls_a", "cls_b", "det_c", "full_d",
        "cls_a__ref", "cls_b__ref", "det_c__ref", "full_d__ref",
        "r50_s0", "r50_s1", "r50_s2", "r50_s3a", "r50_s3b", "r50_s2c", "r50_s3c", "r50_full_d",
    ])


def test_compare_variants_get_their_own_blocks() -> None:
    plan = load_plan(ROOT / "tests" / "plans" / "r18_three_cuts.yaml")
    files = generator.render(plan)
    names = generator.model_names(files)
    assert "t18_one__triton_cpu" in names and "r18_a__triton_cpu" in names
    force_cpu = {m: parse_pbtxt(files[f"{m}/config.pbtxt"].decode()).parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value
                 for m in ("r18_a", "r18_b", "r18_b__triton_cpu", "t18_one__ref")}
    # Activations stay on the GPU between triton-gpu blocks; a GPU block takes the image where the
    # client put it (host memory, or a CUDA shared-memory region); a triton-cpu block, in host memory.
    assert force_cpu == {"r18_a": "no", "r18_b": "no", "r18_b__triton_cpu": "yes", "t18_one__ref": "no"}
    ens = parse_pbtxt(files["t18_one__triton_cpu/config.pbtxt"].decode())
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["r18_a__triton_cpu", "r18_b__triton_cpu", "r18_c1__triton_cpu"]


def test_gpu_blocks_take_the_image_where_the_client_put_it() -> None:
    import yaml

    from blockflow.plan import parse_plan

    def force_cpu(files: dict[str, bytes], model: str) -> str:
        return parse_pbtxt(files[f"{model}/config.pbtxt"].decode()).parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value

    raw = yaml.safe_load((ROOT / "plans" / "default.yaml").read_text())
    files = generator.render(parse_plan(raw))
    # A TensorMQ plan: the first block and the references take a CUDA shared-memory image on the
    # GPU, with no copy through the host; tickets are host bytes.
    assert [force_cpu(files, m) for m in ("r50_s0", "cls_a__ref", "r50_s1", "r50_s3a")] == ["no", "no", "yes", "yes"]
    enc = yaml.safe_load(yaml.safe_dump(raw))
    for model in enc["models"].values():
        model["input"] = {"dtype": "encoded"}
    # JPEG/PNG files are parsed on the host and nvJPEG takes host bytes: taken in host memory.
    assert force_cpu(generator.render(parse_plan(enc)), "r50_s0") == "yes"
    raw["defaults"]["placement"] = "cpu"  # a CPU block takes everything in host memory
    files = generator.render(parse_plan(raw))
    assert {force_cpu(files, m) for m in ("r50_s0", "cls_a__ref", "r50_s1")} == {"yes"}


def test_references_run_the_first_blocks_instances_unless_the_plan_says() -> None:
    import yaml

    from blockflow.plan import parse_plan

    def counts(raw: dict[str, Any]) -> dict[str, int]:
        files = generator.render(parse_plan(raw))
        return {m: parse_pbtxt(files[f"{m}/config.pbtxt"].decode()).instance_group[0].count for m in ("cls_a__ref", "r50_s0")}

    raw = yaml.safe_load((ROOT / "plans" / "default.yaml").read_text())
    raw["blocks"]["r50_s0"]["instances"] = 2
    assert counts(raw) == {"cls_a__ref": 2, "r50_s0": 2}
    raw["reference_instances"] = 4
    assert counts(raw) == {"cls_a__ref": 4, "r50_s0": 2}


def test_ensemble_batch_is_min_of_path() -> None:
    plan = load_plan(ROOT / "tests" / "plans" / "r34_late_cuts.yaml")
    files = generator.render(plan)
    assert parse_pbtxt(files["t34/config.pbtxt"].decode()).max_batch_size == 8
    assert parse_pbtxt(files["r34_fc/config.pbtxt"].decode()).max_batch_size == 16


def test_render_is_deterministic_across_processes(tmp_path: Path) -> None:
    code = ("import sys, hashlib; from blockflow.plan import load_plan; from ensemble_gen import generator;"
            "f = generator.render(load_plan(sys.argv[1]));"
            "print(hashlib.sha256(b''.join(k.encode() + v for k, v in f.items())).hexdigest())")
    plan = str(ROOT / "plans" / "default.yaml")
    env = dict(os.environ, PYTHONHASHSEED="random")
    digests = {subprocess.run([sys.executable, "-c", code, plan], capture_output=True, text=True, env=env,
                              check=True, cwd=ROOT).stdout for _ in range(2)}
    assert len(digests) == 1


def test_write_replaces_atomically_and_refuses_foreign_dirs(tmp_path: Path) -> None:
    files = generator.render(load_plan(ROOT / "tests" / "plans" / "r34_late_cuts.yaml"))
    repo = tmp_path / "repo"
    generator.write(files, repo)
    assert generator.diff(files, repo) == []
    (repo / "stale_model").mkdir()
    generator.write(files, repo)  # regenerating removes what the plan no longer has
    assert generator.diff(files, repo) == []
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # no temporary leftovers

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(GenerateError, match="not generated by BlockFlow"):
        generator.write(files, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_failed_write_leaves_old_repository(tmp_path: Path) -> None:
    files = generator.render(load_plan(ROOT / "tests" / "plans" / "r34_late_cuts.yaml"))
    repo = tmp_path / "repo"
    generator.write(files, repo)
    broken = dict(files)
    broken["t34/config.pbtxt/oops"] = b"x"  # a file below a file: the write must fail
    with pytest.raises(GenerateError):
        generator.write(broken, repo)
    assert generator.diff(files, repo) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_diff_reports_missing_extra_and_changed(tmp_path: Path) -> None:
    files = generator.render(load_plan(ROOT / "tests" / "plans" / "r34_late_cuts.yaml"))
    repo = tmp_path / "repo"
    generator.write(files, repo)
    (repo / "t34" / "config.pbtxt").write_text("changed")
    (repo / "r34_fc" / "1" / "model.py").unlink()
    (repo / "extra.txt").write_text("x")
    d = generator.diff(files, repo)
    assert "differs: t34/config.pbtxt" in d and "missing: r34_fc/1/model.py" in d and "extra:   extra.txt" in d


def test_fuse_auto_joins_blocks_the_same_tasks_traverse() -> None:
    from blockflow.plan import load_plan

    plan = load_plan(ROOT / "tests" / "plans" / "fused.yaml")
    segs = {t.name: [tuple(b.name for b in seg) for seg in plan.segments(t)] for t in plan.tasks.values()}
    assert segs == {"f_one": [("trunk0", "trunk1"), ("h1_a", "h1_b")], "f_two": [("trunk0", "trunk1"), ("h2_a", "h2_b")]}
    names = generator.model_names(generator.render(plan))
    assert "trunk0__to__trunk1" in names and "h1_a__to__h1_b__triton_cpu" in names
    assert not any(n in names for n in ("trunk0", "trunk1", "h1_a", "h2_b"))
    # The default plan fused: the shared trunk r50_s0+s1, and det_c's own s2c+s3c; r50_s2 (two tasks) stays alone.
    raw = load_plan(ROOT / "plans" / "default.yaml").raw.model_dump(mode="json", exclude_none=True)
    from blockflow.plan import parse_plan

    fused = parse_plan(dict(raw, fuse="auto"), base_dir=ROOT / "plans")
    names = generator.model_names(generator.render(fused))
    assert {"r50_s0__to__r50_s1", "r50_s2", "r50_s3a", "r50_s2c__to__r50_s3c", "r50_full_d"} <= set(names)


def test_fusion_stops_at_a_different_deployment() -> None:
    from blockflow.plan import load_plan, parse_plan

    raw = load_plan(ROOT / "tests" / "plans" / "fused.yaml").raw.model_dump(mode="json", exclude_none=True)
    raw["blocks"]["trunk1"]["instances"] = 2
    plan = parse_plan(raw, base_dir=ROOT / "tests" / "plans")
    assert [len(s) for s in plan.segments(plan.tasks["f_one"])] == [1, 1, 2]


def _packed_raw() -> dict[str, Any]:
    from blockflow.plan import load_plan

    return load_plan(ROOT / "tests" / "plans" / "packed.yaml").raw.model_dump(mode="json", exclude_none=True)


def test_pack_heads_runs_the_heads_after_one_segment_as_one_model() -> None:
    from blockflow.core.spec import ModelSpec
    from blockflow.ensemble_gen.configs import parse_pbtxt
    from blockflow.plan import load_plan

    plan = load_plan(ROOT / "tests" / "plans" / "packed.yaml")
    packs = {t: p.name for t, p in plan.head_packs.items()}
    assert packs == {"p_one": "ptrunk0__to__ptrunk1__heads", "p_two": "ptrunk0__to__ptrunk1__heads",
                     "p_three": "pmid__heads", "p_four": "pmid__heads"}
    assert [u.name for u in plan.deployed(plan.tasks["p_one"])] == ["ptrunk0__to__ptrunk1", "ptrunk0__to__ptrunk1__heads"]
    files = generator.render(plan)
    names = generator.model_names(files)
    assert not any(n in names for n in ("ph1_a__to__ph1_b", "ph2", "ph3", "ph4", "ph3__triton_cpu"))
    cfg = parse_pbtxt(files["ptrunk0__to__ptrunk1__heads/config.pbtxt"].decode())
    assert [o.name for o in cfg.output] == ["LOGITS__p_one", "LOGITS__p_two"]
    spec = ModelSpec.model_validate_json(cfg.parameters["blockflow.spec"].string_value)
    assert spec.kind == "pack" and [h.task for h in spec.heads] == ["p_one", "p_two"]
    assert [[p.block for p in h.parts] for h in spec.heads] == [["ph1_a", "ph1_b"], ["ph2"]]
    ens = parse_pbtxt(files["p_three/config.pbtxt"].decode())  # p_three runs on triton-cpu
    last = ens.ensemble_scheduling.step[-1]
    assert last.model_name == "pmid__heads__triton_cpu" and dict(last.output_map) == {"LOGITS__p_three": "LOGITS"}


def test_pack_leaves_lone_and_shared_heads_alone() -> None:
    from blockflow.plan import parse_plan

    raw = _packed_raw()
    del raw["tasks"]["p_two"]  # p_one's head is now the only one after the trunk
    raw["tasks"]["p_five"] = {"path": ["ptrunk0", "ptrunk1", "pmid", "ph4"]}  # ph4 now serves two tasks
    plan = parse_plan(raw, base_dir=ROOT / "tests" / "plans")
    assert plan.head_packs == {}
    assert any("packs nothing" in w for w in plan.warnings())


def test_heads_deployed_differently_form_separate_packs() -> None:
    from blockflow.plan import parse_plan

    raw = _packed_raw()
    raw["tasks"]["p_five"] = {"path": ["ptrunk0", "ptrunk1", "pmid", "h5"]}
    raw["tasks"]["p_six"] = {"path": ["ptrunk0", "ptrunk1", "pmid", "h6"]}
    raw["blocks"]["h5"] = {"model": "r18", "stages": 3, "precision": "fp16", "weights": {"seed": 37}}
    raw["blocks"]["h6"] = {"model": "r18", "stages": 3, "precision": "fp16", "weights": {"seed": 38}}
    plan = parse_plan(raw, base_dir=ROOT / "tests" / "plans")
    packs = {t: p.name for t, p in plan.head_packs.items()}
    assert packs["p_three"] == packs["p_four"] == "pmid__heads" and packs["p_five"] == packs["p_six"] == "pmid__heads2"


def test_a_pack_spec_needs_heads() -> None:
    from pydantic import ValidationError

    from blockflow.core.spec import ModelSpec
    from blockflow.plan import load_plan

    plan = load_plan(ROOT / "tests" / "plans" / "packed.yaml")
    spec, _ = generator.pack_spec(plan, plan.head_packs["p_one"], "tensormq")
    with pytest.raises(ValidationError, match="heads exactly when"):
        ModelSpec.model_validate({**spec.model_dump(), "heads": ()})
    outputs = [o for o, _ in spec.head_specs()]
    assert outputs == ["LOGITS__p_one", "LOGITS__p_two"]


def test_memory_model_counts_one_process_per_pack() -> None:
    from blockflow.plan import load_plan, memory

    plan = load_plan(ROOT / "tests" / "plans" / "packed.yaml")
    cal = memory.Calibration()
    names = sorted(p.model for p in memory.modular(plan, 1, cal))
    assert names == sorted(["ptrunk0__to__ptrunk1", "ptrunk0__to__ptrunk1__heads", "ptrunk0__to__ptrunk1__triton_cpu",
                            "pmid__triton_cpu", "pmid__heads__triton_cpu"])
    # N = 100, the thesis' scenario 8 (90% of tasks run a whole network of their own): packing (their
    # whole networks too, eight to a pack) wins it.
    row = next(r for r in memory.scenario_table("resnet50", 100, memory.Calibration()) if r["scenario"] == 8)
    assert row["processes_packed"] == 16 < row["processes_traditional"] < row["processes_fused"]
    assert row["packed_mib"] < min(row["traditional_mib"], row["fused_mib"])


def test_one_model_per_task_weighs_each_part_in_its_blocks_precision() -> None:
    from blockflow.plan import load_plan, memory

    plan = load_plan(ROOT / "tests" / "plans" / "bf16_hops.yaml")  # a bf16 trunk, an fp32 head_a
    cal = memory.Calibration()
    split = {p.model: p.weights_mib for p in memory.modular(plan, 1, cal)}
    whole = {p.model: p.weights_mib for p in memory.traditional(plan, 1, cal)}
    assert whole["task_a"] == pytest.approx(split["trunk"] + split["head_a"])
    assert whole["task_b"] == pytest.approx(split["trunk"] + split["head_b"])
    assert split["head_a"] == pytest.approx(2 * split["head_b"])  # same stages, fp32 against bf16
    # A path that goes on from one model's blocks to another's: each weighed as its own model; a
    # detector's whole model graphs its traced stages, as its last block does.
    vision = load_plan(ROOT / "plans" / "bench_vision.yaml")
    split = {p.model: p for p in memory.modular(vision, 1, cal)}
    whole = {p.model: p for p in memory.traditional(vision, 1, cal)}
    assert whole["detect"].weights_mib == pytest.approx(split["backbone"].weights_mib + split["detect_rest"].weights_mib)
    assert whole["segment"].weights_mib == pytest.approx(split["backbone"].weights_mib + split["segment_rest"].weights_mib)
    assert whole["detect"].cuda_graphs and whole["detect"].overhead_mib == cal.process_mib


def test_a_pack_pays_one_full_graph_pool_and_a_share_for_each_further_head() -> None:
    import yaml

    from blockflow.plan import memory, parse_plan

    packed = load_plan(ROOT / "tests" / "plans" / "packed.yaml")
    raw = yaml.safe_load((ROOT / "tests" / "plans" / "packed.yaml").read_text())
    raw["pack"] = "none"
    unpacked = parse_plan(raw)
    one = memory.Calibration(activation_factor=1.0, pack_head_factor=1.0)
    split = memory.Calibration(activation_factor=3.0, pack_head_factor=1.0)
    pack = next(p for p in memory.modular(packed, 1, one) if p.model == "ptrunk0__to__ptrunk1__heads")
    heads = [p for p in memory.modular(unpacked, 1, one) if p.model in ("ph1_a__to__ph1_b", "ph2")]
    assert len(heads) == 2 and pack.weights_mib == sum(h.weights_mib for h in heads)
    # Factors of 1: the pack pays what its heads would alone; with 3 for the largest, that head's pool thrice.
    assert abs(pack.activations_mib - sum(h.activations_mib for h in heads)) < 1e-9
    pack3 = next(p for p in memory.modular(packed, 1, split) if p.model == pack.model)
    assert abs(pack3.activations_mib - (3 * max(h.activations_mib for h in heads) + min(h.activations_mib for h in heads))) < 1e-9


def test_an_old_calibration_is_refused_with_the_fix(tmp_path: Path) -> None:
    from blockflow.core.errors import CalibrationError
    from blockflow.plan import memory

    old = tmp_path / "cal.json"
    old.write_text(json.dumps({"process_mib": 805.0, "activation_factor": 2.34, "server_mib": 846.0}))
    with pytest.raises(CalibrationError, match="refit"):
        memory.Calibration.load(old)
    memory.Calibration().save(old)
    assert memory.Calibration.load(old) == memory.Calibration()


def test_served_test_plans_have_distinct_model_names() -> None:
    """The integration server serves every test plan at once: a model name in two repositories is ambiguous."""
    from tests.conftest import SERVED_PLANS

    seen: dict[str, str] = {}
    for path in SERVED_PLANS:
        for name in generator.model_names(generator.render(load_plan(path))):
            assert name not in seen, f"{name} is in both {seen[name]} and {path.name}"
            seen[name] = path.name


def test_config_changes_name_each_field_that_differs() -> None:
    from blockflow.ensemble_gen.configs import config_changes

    a = generator.by_model(generator.render(load_plan(ROOT / "tests" / "plans" / "live_a.yaml")))
    b = generator.by_model(generator.render(load_plan(ROOT / "tests" / "plans" / "live_b.yaml")))
    assert config_changes(a["head_keep"]["config.pbtxt"].decode(), b["head_keep"]["config.pbtxt"].decode()) == [
        "dynamic_batching.max_queue_delay_microseconds: 200 → 50", "instance_group[0].count: 1 → 2"]
    assert config_changes(a["trunk"]["config.pbtxt"].decode(), b["trunk"]["config.pbtxt"].decode()) == []
    fp16 = a["head_keep"]["config.pbtxt"].decode().replace('\\"precision\\":\\"fp32\\"', '\\"precision\\":\\"fp16\\"')
    assert "spec.precision: fp32 → fp16" in config_changes(a["head_keep"]["config.pbtxt"].decode(), fp16)
