"""The like-for-like table, from runs' results trimmed under tests/fixtures/results."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockflow.bench import like_for_like as lfl

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "results"
RESULTS = FIXTURES / "h100" / "like_for_like-2026-11-25-bbab3a1"


HOST_ROWS = tuple(r for r in lfl.DEFAULT_ROWS if r.input == "host")
CUDA_SHM_ROWS = tuple(r for r in lfl.DEFAULT_ROWS if r.input == "cuda-shm" and r.precision != "fp32")  # as measured at 2ada004
FOUR_ROWS = lfl.ROWS[:4]  # what the runs before tf32 with CUDA shared memory measured


@pytest.mark.parametrize(("results", "measured"), [(RESULTS.with_name("like_for_like-2026-11-27-dd9afb6"), HOST_ROWS),
                                                   (RESULTS.with_name("like_for_like-2026-11-27-2ada004"), CUDA_SHM_ROWS),
                                                   (RESULTS.with_name("like_for_like-2026-11-26-9364086"), FOUR_ROWS),
                                                   (FIXTURES / "h200" / "like_for_like-2026-11-28-e116978", lfl.DEFAULT_ROWS)],
                         ids=lambda p: p.name if isinstance(p, Path) else str(len(p)))
def test_each_runs_table_is_the_summary_of_its_rows(results: Path, measured: tuple[lfl.Row, ...]) -> None:
    md = lfl.summary(results, measured)
    rows = [line for line in md.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == len(measured) and "\n".join(lfl.HEADER) in md
    assert f"commit {results.name.rsplit('-', 1)[1]}" in md and "Not measured yet" not in md
    # The table that run wrote; its verdicts against the targets follow the targets in force now.
    assert _tables((results / "like_for_like.md").read_text()) == _tables(md)


def _tables(md: str) -> list[str]:
    return [line for line in md.splitlines() if not line.startswith("- ")]


def test_the_rows_dates_span_from_the_first_started_to_the_last() -> None:
    # dd9afb6's rows ran tf32, fp32, then fp16: the table's order is not the order they ran in.
    md = lfl.summary(RESULTS.with_name("like_for_like-2026-11-27-dd9afb6"), HOST_ROWS)
    assert "rows started 2026-11-27 10:32:24 UTC to 2026-11-27 10:49:32 UTC" in md


def test_each_row_is_checked_against_the_targets() -> None:
    checks = {line.split(":")[0][2:]: line for line in lfl.summary(RESULTS, FOUR_ROWS).splitlines() if line.startswith("- ")}
    assert set(checks) == {r.label for r in FOUR_ROWS}
    assert "split/mono c1 1.292× (meets ≤ 1.3×)" in checks["fp32, host memory"]
    assert "hop 0.437 ms (misses ≤ 0.22 ms)" in checks["fp16, CUDA shared memory"]
    assert "c32 0.419× (misses ≥ 0.95×)" in checks["fp16, CUDA shared memory"]


def test_a_row_cut_short_is_measured_again(tmp_path: Path) -> None:
    for row in lfl.ROWS[:2]:
        shutil.copytree(RESULTS / row.name, tmp_path / row.name)
    res = json.loads((tmp_path / "fp16_cudashm" / "results.json").read_text())
    res["meta"]["complete"] = False
    (tmp_path / "fp16_cudashm" / "results.json").write_text(json.dumps(res))
    md = lfl.summary(tmp_path)
    assert md.count("| fp16, ") == 1 and "Not measured yet: fp16_cudashm, tf32_host, fp32_host, tf32_cudashm, fp32_cudashm" in md


def test_each_row_runs_blockflow_bench_at_its_precision_and_input() -> None:
    cmd = lfl.bench_command(lfl.ROWS[1], Path("plans/bench_r50.yaml"), Path("out"), 3, 1.0, mps=False)
    assert cmd[1:] == ["-m", "blockflow", "bench", "--plan", "plans/bench_r50.yaml", "--precision", "fp16", "--input", "cuda-shm",
                       "--sections", "concurrency", "--concurrency", "1,32", "--seconds", "1", "--repeats", "3",
                       "--out", "out/fp16_cudashm"]


def test_a_model_that_failed_leaves_its_row_uncompared(tmp_path: Path) -> None:
    shutil.copytree(RESULTS / "fp32_host", tmp_path / "fp32_host")
    res = json.loads((tmp_path / "fp32_host" / "results.json").read_text())
    res["concurrency"]["tensormq"]["32"] = {"error": "perf_analyzer failed"}
    (tmp_path / "fp32_host" / "results.json").write_text(json.dumps(res))
    md = lfl.summary(tmp_path, lfl.ROWS[3:4])
    assert "| fp32, host memory | 3.65 ms ±1% (969/s ±4%) | failed | — | — |" in md
    assert "- fp32, host memory: not compared" in md
    # Measured at neither c1 nor c32 (a run at c256 only): not measured here, not failed.
    for model in ("tensormq", "monolithic-graph"):
        if model in res["concurrency"]:
            res["concurrency"][model] = {"256": {"p50_ms": 30.0, "throughput": 9000.0}}
    assert lfl._c1_c32(res["concurrency"], "tensormq") == "—" and not lfl._failed(res["concurrency"], "tensormq")
    assert lfl._failed({"tensormq": {}}, "tensormq")


def test_turns_compare_each_turn_with_its_neighbours_of_the_other_value(tmp_path: Path) -> None:
    from blockflow.bench.lab import turns

    row = lfl.ROWS[0]
    base = json.loads((RESULTS / row.name / "results.json").read_text())
    for name, split_ms in zip(turns.turn_names(["0", "1", "0", "1"]), [4.0, 3.5, 4.2, None], strict=True):
        if split_ms is None:
            continue  # the last turn never finished
        res = json.loads(json.dumps(base))
        res["concurrency"]["tensormq"]["1"]["p50_ms"] = split_ms
        (tmp_path / name / row.name).mkdir(parents=True)
        (tmp_path / name / row.name / "results.json").write_text(json.dumps(res))
    md = turns.summary(tmp_path, "X", ["0", "1", "0", "1"], row)
    assert "| 4 | X=1: not finished |" in md and md.count("| X=") == 4 + 3  # the c1 table, then the load table
    assert "| 2 | X=1 | c32 | 2091 | 2073 | 0.99× | — | — | — | — |" in md
    assert "- turn 2 (X=1): 3.50 ms, -0.60 ms" in md and "- turn 3 (X=0): 4.20 ms, +0.70 ms" in md
    assert "- X=1: median -0.60 ms over 1 turns, lower in 1" in md
    # Arguments every turn's bench had (--also) are named above the table.
    assert "every one with" not in md
    assert "a fresh server per turn (every one with `--warm-cores-ms 50`)" in turns.summary(tmp_path, "X", ["0", "1", "0", "1"], row,
                                                                                           ["--warm-cores-ms", "50"])


def test_turns_under_load_only_take_c1_from_the_batch_section_and_list_load(tmp_path: Path) -> None:
    from blockflow.bench.lab import turns

    row = lfl.ROWS[0]
    base = json.loads((RESULTS / row.name / "results.json").read_text())
    for name, split_ms, per_s in zip(turns.turn_names(["a", "b"]), [2.5, 2.3], [7000.0, 7400.0], strict=True):
        res = json.loads(json.dumps(base))
        cpu = {"total": 1.7, "own_blocks": 0.8}
        res["concurrency"] = {"monolithic-graph": {"256": {"p50_ms": 30.0, "throughput": 8000.0}, "512": {"throughput": 9000.0}},
                              "tensormq": {"256": {"p50_ms": 33.0, "throughput": per_s, "host_cpu_ms_per_inference": cpu,
                                                   "energy_mj_per_inference": 64.0},
                                           "512": {"error": "perf_analyzer failed"}}}  # the load row falls back to c256
        res["batch"] = {"tensormq": {"1": {"p50_ms": split_ms}}}
        (tmp_path / name / row.name).mkdir(parents=True)
        (tmp_path / name / row.name / "results.json").write_text(json.dumps(res))
    # A third turn cut short after the split's batch 1: counted with what it measured, said to be cut short.
    res["meta"]["complete"] = False
    res["concurrency"] = {"monolithic-graph": {"256": {"p50_ms": 30.0, "throughput": 8000.0}}}
    res["batch"] = {"tensormq": {"1": {"p50_ms": 2.6}}}
    (tmp_path / "3_a" / row.name).mkdir(parents=True)
    (tmp_path / "3_a" / row.name / "results.json").write_text(json.dumps(res))
    md = turns.summary(tmp_path, "X", ["a", "b", "a"], row)
    assert "| 2 | X=b | c256 | 8000 | 7400 | 0.93× | — | 1.700 (0.800) | — | 64.0 |" in md
    assert "| 3 | X=a (cut short) |" in md and "| 3 | X=a | c256" not in md
    assert "- turn 2 (X=b): 2.30 ms, -0.25 ms" in md and "- turn 3 (X=a): 2.60 ms, +0.30 ms" in md


def test_turns_set_an_environment_variable_or_a_bench_option(tmp_path: Path) -> None:
    from blockflow.bench.lab import turns

    cmd = lfl.bench_command(lfl.ROWS[0], Path("plan.yaml"), tmp_path, 3, 1.0, mps=False)
    by_env, environ = turns.turn_call(cmd, "BLOCKFLOW_TMQ_EARLY", None, "0")
    assert by_env == cmd and environ["BLOCKFLOW_TMQ_EARLY"] == "0"
    by_option, environ = turns.turn_call(cmd, None, "--warm-cores-ms", "50")
    assert by_option == [*cmd, "--warm-cores-ms", "50"] and "--warm-cores-ms" not in cmd
    # An option is spelled as `blockflow bench` takes it; a bare word is refused before any turn runs.
    run = subprocess.run([sys.executable, "-m", "blockflow.bench.lab.turns", "--option=warm-cores-ms", "--values", "0,50",
                          "--out", str(tmp_path / "t")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--option takes the option as `blockflow bench` spells it" in run.stderr, run.stderr
    assert not (tmp_path / "t").exists()


def test_a_turns_value_that_is_a_path_names_its_directory() -> None:
    """``--option=--plan`` alternates plans: the turn's directory keeps the path readable, without slashes."""
    from blockflow.bench.lab import turns

    assert turns.turn_names(["/tmp/r50_x1.yaml", "plans/b.yaml"]) == ["1__tmp_r50_x1.yaml", "2_plans_b.yaml"]
    cmd, _ = turns.turn_call(["python", "-m", "blockflow", "bench", "--plan", "plans/a.yaml"], None, "--plan", "plans/b.yaml")
    assert cmd[-2:] == ["--plan", "plans/b.yaml"]  # the last --plan is the one argparse keeps


def test_turns_already_measured_in_the_output_directory_are_named_and_not_run_again(tmp_path: Path) -> None:
    from blockflow.bench.lab import turns

    row = lfl.ROWS[0]
    for name in turns.turn_names(["0", "1"]):
        shutil.copytree(RESULTS / row.name, tmp_path / name / row.name)
    run = subprocess.run([sys.executable, "-m", "blockflow.bench.lab.turns", "--env", "X", "--values", "0,1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    for name in turns.turn_names(["0", "1"]):
        assert f"[turns] {name}: already measured in {tmp_path / name}, not run again" in run.stdout
    assert "| 2 | X=1 |" in (tmp_path / "turns.md").read_text()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent's death signal is Linux's")
def test_a_turn_s_bench_ends_when_the_turns_process_is_killed(tmp_path: Path) -> None:
    """Killing ``turns`` (an outer timeout, a machine's time running out) ends the turn it runs, and so its server."""
    pidfile = tmp_path / "turn.pid"
    turn = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    code = (
        "import argparse, sys\n"
        "from pathlib import Path\n"
        "from blockflow.bench.lab import turns\n"
        f"args = argparse.Namespace(option=None, env='X', values='0', also='', out=Path({str(tmp_path / 'out')!r}), turn_s=120.0)\n"
        f"turns.run_turns(argparse.ArgumentParser(), args, 'a turn', lambda d: [sys.executable, '-c', {turn!r}],\n"
        "                 lambda d: False, lambda s, v, a: '', 't.md')\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the turn never started"
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        assert _running(pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid), "the turn outlived the turns process"
    finally:
        parent.kill()
        if pidfile.exists() and pidfile.read_text() and _running(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_turn_measured_at_concurrency_1_only_shows_its_c1_figures(tmp_path: Path) -> None:
    """``turns --also="--concurrency 1"``: the c32 cells stay empty and the turn is compared, not called failed."""
    from blockflow.bench.lab import turns

    row = lfl.ROWS[0]
    res = json.loads((RESULTS / row.name / "results.json").read_text())
    for model in res["concurrency"].values():
        del model["32"]
    line, figures = lfl.table_row(row, res)
    assert "failed" not in line and "/s" not in line and figures is not None and set(figures) == {"c1_ratio", "hop_ms"}
    assert f"| {figures['c1_ratio']:.2f}×, — | {figures['hop_ms']:.2f} ms |" in line
    (tmp_path / "1_0" / row.name).mkdir(parents=True)
    (tmp_path / "1_0" / row.name / "results.json").write_text(json.dumps(res))
    md = turns.summary(tmp_path, "X", ["0", "1"], row)
    assert "| 1 | X=0 | " in md and "| 2 | X=1: not finished |" in md
    # A model that failed at c32 is still a failure.
    failed = json.loads((RESULTS / row.name / "results.json").read_text())
    failed["concurrency"][lfl.SPLIT]["32"] = {"error": "perf_analyzer failed"}
    assert lfl.table_row(row, failed)[1] is None and "| failed |" in lfl.table_row(row, failed)[0]


def test_a_uint8_row_with_instances_serves_a_copy_of_the_plan(tmp_path: Path) -> None:
    row = next(r for r in lfl.ROWS if r.name == "fp16_u8_host")
    plan = Path(__file__).parents[2] / "plans" / "bench_r50.yaml"
    assert lfl.row_plan(lfl.ROWS[0], plan, tmp_path, None) == plan  # nothing to change: the plan itself
    copy = lfl.row_plan(row, plan, tmp_path, 4, 2)
    assert copy == tmp_path / "fp16_u8_host" / "plan.yaml"
    from blockflow.plan.load import load_plan

    served = load_plan(copy)
    assert served.blocks["b0"].instances == 4 and served.blocks["b1"].instances == served.blocks["b3"].instances == 2
    assert all(m.image is not None and m.image.dtype == "uint8" for m in served.models.values())
    # --instances sets the unsplit model's too, whatever the plan said.
    own = tmp_path / "own.yaml"
    own.write_text(plan.read_text() + "reference_instances: 8\n")
    assert load_plan(lfl.row_plan(row, own, tmp_path / "own", 4)).raw.reference_instances is None


def test_the_best_throughput_over_more_concurrencies_is_shown_against_the_gpu_alone() -> None:
    res = json.loads((FIXTURES / "h200" / "like_for_like-2026-11-28-e116978" / "fp16_host" / "results.json").read_text())
    res["meta"]["gpu_alone"] = {"batch1_ms": 0.64, "images_per_s": {"32": 10000.0}}
    res["concurrency"][lfl.SPLIT]["128"] = dict(res["concurrency"][lfl.SPLIT]["32"], throughput=6000.0)
    text = lfl.served_over_alone(res)
    assert "best" in text and "split 6000/s = 60% (c128)" in text


def test_each_models_best_is_checked_against_the_gpu_alone_where_it_was_measured() -> None:
    res = json.loads((FIXTURES / "h200" / "like_for_like-2026-11-28-e116978" / "fp16_host" / "results.json").read_text())
    assert lfl.alone_checks(res) == ""  # measured before the GPU alone was
    res["meta"]["gpu_alone"] = {"batch1_ms": 0.64, "images_per_s": {"32": 10000.0}}
    res["concurrency"][lfl.MONO]["128"] = dict(res["concurrency"][lfl.MONO]["32"], throughput=6100.0)
    text = lfl.alone_checks(res)
    assert "; unsplit best / GPU alone 0.610 (meets ≥ 0.6)" in text and "; split best / GPU alone 0.2" in text and "misses ≥ 0.6" in text


def test_a_closed_loop_on_a_few_threads_asks_perf_analyzer_for_its_asynchronous_mode(tmp_path: Path) -> None:
    """``--client-threads N``: perf_analyzer's concurrency loop on N threads, not a thread per request in flight."""
    from blockflow.bench.perf_analyzer import load_args

    assert load_args(256, None) == ["--concurrency-range", "256"]  # synchronous: 256 threads
    assert load_args(256, None, 8) == ["--concurrency-range", "256", "--async", "--max-threads", "8"]
    assert load_args(None, 120.0, 8)[:2] == ["--request-rate-range", "120.000"]  # a rate keeps its own threads
    cmd = lfl.bench_command(lfl.ROWS[0], Path("plan.yaml"), tmp_path, 2, 1.0, mps=False, concurrency="1,256", client_threads=8)
    assert cmd[cmd.index("--client-threads") + 1] == "8"
    assert "--client-threads" not in lfl.bench_command(lfl.ROWS[0], Path("plan.yaml"), tmp_path, 2, 1.0, mps=False)
    run = subprocess.run([sys.executable, "-m", "blockflow", "bench", "--client-threads", "-1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--client-threads" in run.stderr, run.stderr


def test_a_table_names_perf_analyzer_s_threads_where_a_row_used_few(tmp_path: Path) -> None:
    rows = lfl.ROWS[:2]
    for i, row in enumerate(rows):
        res = json.loads((RESULTS / row.name / "results.json").read_text())
        res["meta"]["client_threads"] = 8 * i
        (tmp_path / row.name).mkdir()
        (tmp_path / row.name / "results.json").write_text(json.dumps(res))
    md = lfl.summary(tmp_path, rows)
    assert "perf_analyzer a thread per request and perf_analyzer on 8 threads (the rows differ); each row" in md
    assert "perf_analyzer" not in lfl.summary(tmp_path, rows[:1])  # the default, as every earlier table ran it


def test_rows_run_at_c1_and_above_c32_only_are_checked_at_each_models_best(tmp_path: Path) -> None:
    src = FIXTURES / "h200" / "like_for_like-2026-11-28-e116978" / "fp16_host" / "results.json"
    res = json.loads(src.read_text())
    res["meta"]["gpu_alone"] = {"batch1_ms": 0.64, "images_per_s": {"32": 10000.0}}
    for model, rate in ((lfl.SPLIT, 5800.0), (lfl.MONO, 6000.0)):
        res["concurrency"][model]["256"] = dict(res["concurrency"][model].pop("32"), throughput=rate)
    (tmp_path / "fp16_host").mkdir()
    (tmp_path / "fp16_host" / "results.json").write_text(json.dumps(res))
    line, figures = lfl.table_row(lfl.ROWS[0], res)
    assert figures is not None and "c32_ratio" not in figures and figures["best_ratio"] == pytest.approx(5800 / 6000)
    assert "; bests 0.97×" in line and lfl.served_over_alone(res) == "of 10,000/s, best unsplit 6000/s = 60% (c256), split 5800/s = 58% (c256)"
    check = next(x for x in lfl.summary(tmp_path, lfl.ROWS[:1]).splitlines() if x.startswith("- "))
    assert "bests 0.967× (meets ≥ 0.95×)" in check and "c32" not in check and "not compared" not in check


def test_a_table_of_rows_that_served_different_copies_of_a_plan_names_each(tmp_path: Path) -> None:
    rows = lfl.ROWS[:2]
    for i, row in enumerate(rows):
        res = json.loads((RESULTS / row.name / "results.json").read_text())
        res["meta"]["plan"] = f"out/{row.name}/plan.yaml" if i else "plans/p.yaml"
        (tmp_path / row.name).mkdir()
        (tmp_path / row.name / "results.json").write_text(json.dumps(res))
    assert "Plans `plans/p.yaml` (fp16_host), `out/fp16_cudashm/plan.yaml` (fp16_cudashm), task" in lfl.summary(tmp_path, rows)
    assert "Plan `plans/p.yaml`, task" in lfl.summary(tmp_path, rows[:1])
