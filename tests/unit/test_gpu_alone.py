"""The GPU alone (blockflow.bench.gpu_alone): the child's answer, where there is no GPU, and the reports that compare with it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blockflow.bench import gpu_alone
from blockflow.bench import like_for_like as lfl
from blockflow.bench.report import write_report

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "results"
BENCH = FIXTURES / "h100" / "bench_r50-2026-11-23-25d3c8d" / "results.json"
LIKE_FOR_LIKE = FIXTURES / "h200" / "like_for_like-2026-11-28-e116978"
FIGURES = {"batch1_ms": 0.9, "images_per_s": {"32": 13579.0, "128": 16364.0}, "batch_ms": {"1": 0.9, "32": 2.357, "128": 7.822},
           "precision": "fp16", "memory_format": "channels_last", "cuda_graph": True, "device": "NVIDIA H200", "task": "r50",
           "replays": {"1": 100, "32": 30, "128": 30}}


def test_the_childs_json_line_is_its_answer() -> None:
    out = "loading plan\n" + json.dumps({"gpu_alone": FIGURES, "reason": None}) + "\n"
    assert gpu_alone.parse_child(0, out, "a warning\n") == (FIGURES, None)
    assert gpu_alone.parse_child(0, json.dumps({"gpu_alone": None, "reason": "no GPU visible to torch"}), "") == (
        None, "no GPU visible to torch")


def test_a_child_that_failed_gives_none_and_its_last_words() -> None:
    figures, reason = gpu_alone.parse_child(1, "", "Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error: boom\n\n")
    assert figures is None and reason == "the measuring process failed (exit 1): RuntimeError: CUDA error: boom"
    assert gpu_alone.parse_child(0, "{not json\n", "")[0] is None
    assert gpu_alone.parse_child(0, '{"other": 1}\n', "")[1] == "the measuring process failed (exit 0): no output"


def test_without_a_gpu_no_child_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    import blockflow.core.nvml

    def no_child(*_a: Any, **_k: Any) -> None:
        raise AssertionError("no process is started without a GPU")

    monkeypatch.setattr(blockflow.core.nvml, "gpu_count", lambda: 0)
    monkeypatch.setattr(subprocess, "run", no_child)
    assert gpu_alone.measure_in_child(Path("plans/bench_r50.yaml"), "r50", "fp16") == (None, "no GPU visible (NVML sees none)")


def test_torch_without_cuda_gives_none_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_alone.measure(ROOT / "plans" / "bench_r50.yaml") == (None, "no GPU visible to torch")


def test_the_cpu_run_measures_the_whole_network_in_the_tasks_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_alone, "REPLAYS", {1: 3})
    monkeypatch.setattr(gpu_alone, "OTHER_REPLAYS", 3)
    monkeypatch.setattr(gpu_alone, "WARM_S", 0.0)
    figures, reason = gpu_alone.measure(ROOT / "tests" / "plans" / "r18_three_cuts.yaml", "t18_two", "tf32", (1, 2), "cpu")
    assert reason is None and figures is not None
    assert (figures["task"], figures["precision"], figures["device"], figures["cuda_graph"]) == ("t18_two", "tf32", "cpu", False)
    assert figures["batch1_ms"] > 0 and set(figures["images_per_s"]) == {"2"} and figures["replays"] == {"1": 3, "2": 3}
    assert "batch 1: " in gpu_alone.describe(figures) and "batch 2: " in gpu_alone.describe(figures)


def test_a_task_of_jpeg_files_is_also_measured_with_its_files_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_alone, "REPLAYS", {1: 3})
    monkeypatch.setattr(gpu_alone, "OTHER_REPLAYS", 3)
    monkeypatch.setattr(gpu_alone, "WARM_S", 0.0)
    figures, reason = gpu_alone.measure(ROOT / "tests" / "plans" / "encoded.yaml", sizes=(1, 2), device="cpu")
    assert reason is None and figures is not None
    assert set(figures["decode_ms"]) == set(figures["images_per_s_decoded"]) == {"2"}
    assert figures["images_per_s_decoded"]["2"] < figures["images_per_s"]["2"]
    assert "batch 2 with its JPEGs decoded: " in gpu_alone.describe(figures)
    res = {"meta": {"gpu_alone": figures}}
    from blockflow.bench.report import alone_b32

    assert alone_b32(res) is None  # no batch 32 here; with one, the decoded figure is what shares are of
    figures["images_per_s_decoded"]["32"], figures["images_per_s"]["32"] = 100.0, 400.0
    assert alone_b32(res) == 100.0


def test_the_bench_records_none_and_why_when_told_to_skip_it() -> None:
    from blockflow.bench.suite import Bench

    lines: list[str] = []
    meta: dict[str, Any] = {}
    Bench._gpu_alone(SimpleNamespace(cfg=SimpleNamespace(gpu_alone=False), log=lines.append), meta)  # type: ignore[arg-type]
    assert meta == {"gpu_alone": None, "gpu_alone_reason": "not asked for (--no-gpu-alone)"}
    assert lines == ["[bench] gpu alone   not measured: not asked for (--no-gpu-alone)"]


def _report(tmp_path: Path, meta: dict[str, Any]) -> str:
    res = json.loads(BENCH.read_text())
    res["meta"].update(meta)
    write_report(res, tmp_path)
    return (tmp_path / "report.md").read_text()


def test_the_report_gives_each_served_row_against_the_gpu_alone(tmp_path: Path) -> None:
    report = _report(tmp_path, {"gpu_alone": FIGURES})
    assert "## The GPU alone" in report and "| 0.900 | 13,579 | 16,364 |" in report and "fp16, channels_last" in report
    conc = json.loads(BENCH.read_text())["concurrency"]
    r = conc["tensormq"]["32"]
    assert f"{r['throughput']:.0f}/s ({100 * r['throughput'] / 13579:.0f}%)" in report
    row = next(line for line in report.splitlines() if line.startswith("| tensormq |") and "% of" not in line and "/s (" in line)
    assert row.endswith(f" {conc['tensormq']['1']['p50_ms'] / 0.9:.1f}× |")
    assert "| c1 p50 / GPU alone b1 |" in report


def test_a_report_without_the_gpu_alone_says_why_or_nothing(tmp_path: Path) -> None:
    report = _report(tmp_path, {"gpu_alone": None, "gpu_alone_reason": "no GPU visible (NVML sees none)"})
    assert "Not measured: no GPU visible (NVML sees none)." in report and "GPU alone b1" not in report
    report = _report(tmp_path, {})  # results from before it: no section, no column
    assert "GPU alone" not in report and "%)" not in report


def test_the_like_for_like_table_adds_the_split_against_the_gpu_alone(tmp_path: Path) -> None:
    for row in lfl.ROWS[:2]:
        shutil.copytree(LIKE_FOR_LIKE / row.name, tmp_path / row.name)
    before = lfl.summary(tmp_path, lfl.ROWS[:2])
    assert "GPU alone" not in before and "\n".join(lfl.HEADER) in before
    res = json.loads((tmp_path / "fp16_host" / "results.json").read_text())
    res["meta"]["gpu_alone"] = FIGURES
    (tmp_path / "fp16_host" / "results.json").write_text(json.dumps(res))
    md = lfl.summary(tmp_path, lfl.ROWS[:2])
    split = res["concurrency"][lfl.SPLIT]["32"]["throughput"]
    assert lfl.HEADER[0] + " served / GPU alone (b32) |" in md
    assert md.count("| fp16, host memory | ") == 1 and f" {100 * split / 13579:.0f}% of 13,579/s |" in md
    assert next(line for line in md.splitlines() if line.startswith("| fp16, CUDA shared memory |")).endswith(" — |")
    assert len([line for line in md.splitlines() if line.startswith("| ")]) == 3  # header and two rows


def test_a_task_with_side_inputs_is_measured_with_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tests import side_programs

    monkeypatch.setattr(gpu_alone, "REPLAYS", {1: 3})
    monkeypatch.setattr(gpu_alone, "OTHER_REPLAYS", 3)
    monkeypatch.setattr(gpu_alone, "WARM_S", 0.0)
    side_programs.scaled(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nmodels: {m: {program: scaled.pt2, cut_points: [body]}}\ndefaults: {placement: cpu}\n"
                    "blocks: {a: {model: m, stages: 0}, b: {model: m, stages: 1}}\ntasks: {t: {path: [a, b]}}\n")
    figures, reason = gpu_alone.measure(plan, "t", None, (1, 2), "cpu")
    assert reason is None and figures is not None and figures["batch1_ms"] > 0
