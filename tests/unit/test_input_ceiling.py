"""The input-ceiling bench's repository is a first block's configuration without its work, and its report names each figure."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.bench.lab import input_ceiling
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]


def _config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def test_the_sink_is_configured_as_the_first_block_is(tmp_path: Path) -> None:
    input_ceiling.write_repository(tmp_path / "sink")
    generator.write(generator.render(load_plan(ROOT / "plans" / "bench_r50.yaml")), tmp_path / "plan")
    sink, b0 = _config(tmp_path / "sink" / "sink_i1" / "config.pbtxt"), _config(tmp_path / "plan" / "b0" / "config.pbtxt")
    assert sink.input == b0.input
    assert sink.max_batch_size == b0.max_batch_size
    assert sink.dynamic_batching == b0.dynamic_batching
    assert sink.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"] == b0.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"]
    assert [o.dims for o in sink.output] == [o.dims for o in b0.output]
    assert _config(tmp_path / "sink" / "sink_i2" / "config.pbtxt").instance_group[0].count == 2
    entry = _config(tmp_path / "sink" / "entry_i1" / "config.pbtxt")
    assert [s.model_name for s in entry.ensemble_scheduling.step] == ["sink_i1"]
    assert "mallopt(-1, 256 << 20)" in (tmp_path / "sink" / "keep_i1" / "1" / "model.py").read_text()
    assert "if False:" in (tmp_path / "sink" / "sink_i1" / "1" / "model.py").read_text()


def test_the_report_gives_each_model_its_figures() -> None:
    fig = {"p50_ms": 1.0, "throughput": 2000.0, "spread": {"p50_ms": 0.1, "throughput": 0.04}}
    res = {
        "meta": {"device": "H100", "cpus": 16, "commit": "abc1234", "seconds": 2.0, "repeats": 3, "image": [3, 224, 224]},
        "figures": {f"{m}|c{c}": fig for m in input_ceiling.MEASURED.values() for c in input_ceiling.CONCURRENCY},
        "stats_c32_last_run": {"sink_i1": {"batch": 6.5, "compute_input": 400.0, "compute_infer": 90.0}},
    }
    text = input_ceiling.report(res)
    assert "| sink, 1 instance | 1.000 ms ±5% | 2000/s ±2% | 1.00 ms | 6.5 | 400, 90 µs |" in text
    assert text.count("\n| sink") == 4


def test_a_plan_adds_its_split_and_unsplit_graph_measured_by_their_first_models(request: pytest.FixtureRequest) -> None:
    repo, labels, firsts = input_ceiling.plan_models(ROOT / "plans" / "bench_r50.yaml", "fp16")
    request.addfinalizer(lambda: shutil.rmtree(repo))
    assert labels == {"the plan's unsplit CUDA graph": "r50__ref_graph", "the plan's 4-block split": "r50"}
    assert firsts == {"r50__ref_graph": "r50__ref_graph", "r50": "b0"}
    assert {p.name for p in repo.iterdir()} >= {"r50", "r50__ref_graph", "b0", "b3"}
    assert '\\"precision\\":\\"fp16\\"' in (repo / "b0" / "config.pbtxt").read_text()  # the spec parameter, JSON in a pbtxt string
