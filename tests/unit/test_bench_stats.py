"""blockflow.bench.triton_stats: the reading of Triton's statistics (pure arithmetic)."""

from __future__ import annotations

from pathlib import Path

from blockflow.bench.triton_stats import block_breakdown, compute_ms, delta


def test_compute_is_per_execution_when_requests_are_batched() -> None:
    # 10 executions of 4 batched requests each, 2 ms each: Triton adds 2 ms for every request (80 ms).
    s = {"executions": 10, "inferences": 40, "requests": 40, "compute_infer_ns": 80_000_000,
         "compute_input_ns": 0, "compute_output_ns": 0, "queue_ns": 40_000_000}
    assert compute_ms(s) == 2.0
    row = block_breakdown({"b0": s}, ["b0"], 1)[0]
    assert row["batch_per_execution"] == 4.0 and row["queue_ms"] == 1.0


def test_delta_subtracts_only_what_was_there() -> None:
    before = {"m": {"executions": 1, "requests": 1}}
    after = {"m": {"executions": 3, "requests": 5}, "n": {"executions": 2, "requests": 2}}
    assert delta(after, before) == {"m": {"executions": 2, "requests": 4}, "n": {"executions": 2, "requests": 2}}


def test_busiest_is_the_share_of_time_each_instance_executed() -> None:
    from blockflow.bench.scenarios import busiest

    # 10 s of load: "pack" ran 1000 executions of 8 ms on 2 instances (40% busy), 4 requests each,
    # whose per-request statistics count each execution 4 times; "s0" ran 500 of 2 ms on one.
    d = {"pack": {"executions": 1000, "requests": 4000, "compute_infer_ns": 4000 * 8_000_000, "queue_ns": 4000 * 1_000_000,
                  "execution_ns": 1000 * 8_000_000},
         "s0": {"executions": 500, "requests": 500, "compute_infer_ns": 500 * 2_000_000, "execution_ns": 500 * 2_000_000},
         "task": {"executions": 900, "requests": 900, "execution_ns": 1}, "idle": {"executions": 0, "requests": 0}}
    rows = busiest(d, {"pack", "s0", "idle"}, 10.0, {"pack": 2, "s0": 1})
    assert [r["model"] for r in rows] == ["pack", "s0"]  # ensembles (not asked for) and idle models left out
    assert abs(rows[0]["busy"] - 0.4) < 1e-9 and rows[0]["compute_ms"] == 8.0
    assert rows[0]["batch"] == 4.0 and rows[0]["queue_ms"] == 1.0
    assert abs(rows[1]["busy"] - 0.1) < 1e-9


def test_packed2_doubles_only_the_blocks_that_get_packed(tmp_path: Path) -> None:
    import yaml

    from blockflow.bench.scenarios import scenario_plans
    from blockflow.plan import load_plan

    paths = scenario_plans("resnet50", 2, 4, tmp_path)
    plan = load_plan(paths["packed2"])
    packed = {b.name for task in plan.head_packs for b in plan.deployed(plan.tasks[task])[-1].blocks}
    raw = yaml.safe_load(paths["packed2"].read_text())
    doubled = {name for name, b in raw["blocks"].items() if b.get("instances") == 2}
    assert doubled == packed == {"c0_3", "c1_3", "c2_3"}  # b0 is the only B task: its head stays alone


def test_tail_serves_only_the_chosen_models_and_switches_the_monitor_off() -> None:
    from blockflow.bench.lab.tail import _variant_plan
    from blockflow.bench.plans import task_models
    from blockflow.plan import load_plan

    plan = load_plan(Path(__file__).resolve().parents[2] / "plans" / "bench_r50.yaml")
    labels = ["tensormq", "triton-gpu", "monolithic-graph"]
    default = _variant_plan(plan, "default", labels)
    assert sorted(task_models(default, "r50")) == sorted(labels)  # no triton-cpu blocks, no eager reference
    assert all(b.monitor_period_s == 2.0 for b in default.blocks.values())
    quiet = _variant_plan(plan, "nomonitor", labels)
    assert all(b.monitor_period_s == 0 for b in quiet.blocks.values())


def test_tail_traced_phases_and_gaps_per_process(tmp_path: Path) -> None:
    """Each execute's phases (read, queue, respond) and the gap to the same process's next call, not another's."""
    import json

    from blockflow.bench.lab.tail import _executes

    ms = 1_000_000
    def execute(start: int, n: int) -> str:  # 1 ms read, 2 ms queue, 0.5 ms respond
        return json.dumps({"kind": "execute", "n": n, "t": [start, start + ms, start + 3 * ms, start + 3 * ms + ms // 2],
                           "gpu_ms": 2.0})
    # Two processes of one block, interleaved in time: each has a 6.5 ms gap between its calls.
    (tmp_path / "b0.b0_0.1.jsonl").write_text("\n".join(execute(t * ms, 4) for t in (0, 10, 20)) + "\n")
    (tmp_path / "b0.b0_1.2.jsonl").write_text("\n".join(execute(t * ms, 2) for t in (5, 15)) + "\n")
    (tmp_path / "b1.b1_0.3.jsonl").write_text(json.dumps({"kind": "memory", "step": "start", "t": 0}) + "\n")
    out = _executes(tmp_path, ["b0", "b1"], 0, 30 * ms)
    assert set(out) == {"b0"}
    b0 = out["b0"]
    assert (b0["executes"], b0["mean_batch"]) == (5, 3.2)
    assert (b0["read_p50"], b0["queue_p50"], b0["respond_p50"], b0["gap_p50"]) == (1.0, 2.0, 0.5, 6.5)
    assert b0["execute_p50"] == 3.5 and b0["gpu_p50"] == 2.0


def test_tail_percentiles_count_stalls() -> None:
    import numpy as np

    from blockflow.bench.lab.tail import SLOW_MS, _percentiles

    ms = np.array([5.0] * 98 + [SLOW_MS + 1, 200.0])
    q = _percentiles(ms)
    assert q["p50"] == 5.0 and q["max"] == 200.0 and q["slow_share"] == 0.02
    assert _percentiles(np.array([])) == {}


def test_a_run_cut_short_still_gives_a_report_that_says_so(tmp_path: Path) -> None:
    import json

    from blockflow.bench.report import write_report

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "results" / "h100" / "bench_r50-2026-11-23-25d3c8d"
    full = json.loads((fixture / "results.json").read_text())
    cut = {k: v for k, v in full.items() if k in ("meta", "config", "task", "path", "models", "memory", "pipeline", "batch", "concurrency")}
    cut["meta"] = dict(full["meta"], complete=False)
    cut["concurrency"] = {k: v for k, v in full["concurrency"].items() if k != "triton-cpu"}  # stopped inside the section
    write_report(cut, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "Incomplete run" in report and "Concurrency (Fig 4.11)" in report and "Offered load" not in report
    write_report(full, tmp_path)  # a finished run (and results files from before the flag) says nothing of the kind
    report = (tmp_path / "report.md").read_text()
    assert "Incomplete run" not in report and "Offered load" in report


def test_load_anatomy_reads_phases_per_execution_and_each_block_window() -> None:
    from blockflow.bench.lab.load_anatomy import block_window
    from blockflow.bench.triton_stats import phases_per_execution

    # 4 executions of 2 requests: batch_stats count each execution once in every phase.
    d = {"executions": 4, "inferences": 8, "queue_ns": 8_000_000, "execution_compute_input_ns": 8_000_000,
         "execution_compute_input_n": 4, "execution_compute_infer_ns": 4_000_000, "execution_compute_infer_n": 4,
         "execution_compute_output_ns": 400_000, "execution_compute_output_n": 4}
    p = phases_per_execution(d)
    assert p["samples_per_execution"] == 2.0 and p["queue_ms_per_request"] == 1.0
    assert (p["compute_input_ms"], p["compute_infer_ms"], p["compute_output_ms"]) == (2.0, 1.0, 0.1)

    ms = 1_000_000
    # Two processes of one block; calls at 0-2 ms and 5-6 ms in one, 1-2 ms in the other; one call outside the window.
    calls = [{"kind": "execute", "n": 2, "t": [0, ms // 2, ms, 2 * ms], "laps": [["run:graph", ms]], "process": "a"},
             {"kind": "execute", "n": 4, "t": [5 * ms, 5 * ms, 5 * ms, 6 * ms], "process": "a", "gpu_ms": 0.5},
             {"kind": "execute", "n": 3, "t": [ms, ms, ms, 2 * ms], "process": "b"},
             {"kind": "execute", "n": 9, "t": [20 * ms, 20 * ms, 20 * ms, 21 * ms], "process": "a"},
             {"kind": "memory", "t": ms}]
    w = block_window(calls, 0, 10 * ms)
    assert w["calls_per_s"] == 300.0 and w["samples_per_call"] == 3.0
    assert abs(w["busy"] - 0.4) < 1e-9  # 4 ms of calls in a 10 ms window
    assert w["gap_ms"] == 3.0  # within process a only: 2 ms -> 5 ms
    assert w["run:graph_ms"] == 0.5 and w["execute_ms"] == 1.0 and w["gpu_ms"] == 0.5
    assert block_window(calls, 30 * ms, 40 * ms) == {}


def test_several_runs_of_a_point_give_each_figures_median_and_spread() -> None:
    from blockflow.bench.perf_analyzer import median_of

    runs = [{"p50_ms": 2.0, "p99_ms": 4.0, "throughput": 500.0}, {"p50_ms": 3.0, "p99_ms": 5.0, "throughput": 400.0},
            {"p50_ms": 2.5, "p99_ms": 9.0, "throughput": 450.0, "unstable": 1.0}]
    r = median_of(runs)
    assert (r["p50_ms"], r["p99_ms"], r["throughput"]) == (2.5, 5.0, 450.0)
    assert abs(r["spread"]["p50_ms"] - 0.4) < 1e-9 and abs(r["spread"]["throughput"] - 100 / 450) < 1e-9
    assert r["unstable"] == 1.0 and [x["p50_ms"] for x in r["runs"]] == [2.0, 3.0, 2.5] and "unstable" not in r["runs"][2]
    two = median_of(runs[:2])
    assert two["p50_ms"] == 2.5 and "unstable" not in two  # an even count: the mean of the middle two
    assert median_of([runs[0], {"error": "perf_analyzer failed"}]) == {"error": "perf_analyzer failed"}


def test_the_stress_check_compares_every_output_a_task_answers() -> None:
    import numpy as np

    from blockflow.bench.stress import difference

    want = {"BOXES": np.array([[[0.0, 0.0, 4.0, 4.0]]], np.float32), "LABELS": np.array([[3]], np.int64)}
    assert difference(dict(want), want) == 0.0
    assert difference({**want, "BOXES": want["BOXES"] + 0.04}, want) == np.float32(0.04) / 4.0
    assert difference({**want, "LABELS": np.array([[2]], np.int64)}, want) == float("inf")
    assert difference({"BOXES": want["BOXES"]}, want) == float("inf")  # an output missing
    assert difference({**want, "BOXES": np.zeros((1, 2, 4), np.float32)}, want) == float("inf")  # another count


def test_a_failed_point_keeps_what_failed_and_the_report_says_it(tmp_path: Path) -> None:
    from blockflow.bench.failures import failures_section
    from blockflow.bench.perf_analyzer import failure

    out = ("*** Measurement Settings ***\nThread [0] had error: in ensemble 'r50', Failed to process the request(s) for model "
           "'r50_b3', message: RuntimeError: boom\n\nAt:\n  /work/main/blockflow/backend/runtime.py(99): run\n"
           "  /work/main/blockflow/backend/model.py(126): execute\n")
    r = failure(out)
    assert r["error"] == 1.0 and r["message"].startswith("Thread [0] had error") and "RuntimeError: boom" in r["message"]
    assert r["detail"].endswith("model.py(126): execute") and "runtime.py(99)" in r["detail"]
    assert failure("")["message"] == "?" and failure("a\nlast words\n")["message"] == "last words"
    # What failed is found on stdout when stderr holds something else too, and the detail ends with stderr's.
    both = failure("Request concurrency: 1\nThread [0] had error: no model 'x'\n", "WARNING: a note\n")
    assert both["message"] == "Thread [0] had error: no model 'x'" and both["detail"].endswith("WARNING: a note")
    res = {"concurrency": {"tensormq": {"1": {"p50_ms": 3.0}, "256": r}}, "rate": {"peak_per_s": 9.0, "tensormq": {"0.5": r}},
           "pipeline": {"tensormq": r}, "gpus": {"skipped": "no", "2": {"tensormq": {"1": {"p50_ms": 3.0}, "32": r}}}}
    lines = failures_section(res)
    assert "- concurrency tensormq c256: Thread [0] had error" in "\n".join(lines)
    assert any(line.startswith("- rate tensormq 0.5× the peak: ") for line in lines)
    assert any(line.startswith("- 2 GPUs tensormq c32: ") for line in lines)
    assert any(line.startswith("- pipeline tensormq: ") for line in lines)
    # The pipeline's point is the batch section's b1 where that ran: named once.
    once = failures_section({"pipeline": {"tensormq": r}, "batch": {"tensormq": {"1": r}}})
    assert [line for line in once if line.startswith("- ")] == [f"- batch tensormq b1: {r['message']}"]
    assert failures_section({"concurrency": {"tensormq": {"1": {"p50_ms": 3.0}}}}) == []
    # In a table's cell: short, and a "|" in the message does not split the row.
    from blockflow.bench.failures import failure_cell

    cell = failure_cell({"error": 1.0, "message": "a | b " + "x" * 200})
    assert cell.startswith("failed: a \\| b ") and cell.endswith("…") and len(cell) < 100
    assert failure_cell({"error": 1.0}) == "failed"
    assert failure_cell({"error": 1.0, "message": "a" * 79 + "|b"}).endswith("a\\|…")  # a whole escape, never half
    # The vision and crossing reports list their failed points too, whole.
    from blockflow.bench import crossing, vision

    long = {"error": 1.0, "message": "error: Failed to retrieve results " + "y" * 300}
    meta = {"task": "t", "plan": "p.yaml", "device": "d", "commit": "c", "repeats": 1, "seconds": 1.0}
    md = crossing.report({"meta": meta, "one_server": {"1": {"p50_ms": 1.0, "throughput": 9.0}, "32": long},
                          "crossing": {"1": {"p50_ms": 2.0, "throughput": 5.0}, "32": {"p50_ms": 3.0, "throughput": 9.0}}})
    assert f"- one_server c32: {long['message']}" in md and "## Failed points" in md
    md = vision.report({"meta": {**meta, "concurrency": [1], "check_batch": 2}, "equal": {},
                        "tasks": {"cls": {"unsplit": {"1": {"p50_ms": 1.0, "throughput": 9.0}}, "split": {"1": long}}}})
    assert f"- cls split c1: {long['message']}" in md


def test_a_failed_point_keeps_only_the_server_log_written_during_it(tmp_path: Path) -> None:
    from blockflow.triton.server import ServerOptions, TritonServer

    server = TritonServer(ServerOptions(repositories=[tmp_path]), runtime_dir=tmp_path, install=object())  # type: ignore[arg-type]
    assert server.log_size() == 0 and server.log_since(0, 30) == []  # no log yet
    server.log_path.write_text("E1130 an earlier point's error\n")
    at = server.log_size()
    with server.log_path.open("a") as f:
        f.write("E1130 model.py: RuntimeError: boom\n\n  /work/main/blockflow/backend/model.py(126): execute\n")
    assert server.log_since(at, 30) == ["E1130 model.py: RuntimeError: boom", "  /work/main/blockflow/backend/model.py(126): execute"]
    assert len(server.log_since(0, 1)) == 1


def test_a_links_batches_come_from_the_blocks_counters() -> None:
    from blockflow.bench.triton_stats import block_breakdown, counters_of, delta

    def text(samples: int, batches: int, waits: int) -> str:
        return "\n".join([
            "# TYPE blockflow_tmq_link_samples_total counter",
            f'blockflow_tmq_link_samples_total{{model="b1",model_instance="b1_0"}} {samples // 2}',
            f'blockflow_tmq_link_samples_total{{model="b1",model_instance="b1_1"}} {samples - samples // 2}',
            "# TYPE blockflow_tmq_link_batches_total counter",
            f'blockflow_tmq_link_batches_total{{model="b1",model_instance="b1_0"}} {batches}',
            "# TYPE blockflow_tmq_pool_waits_total counter",
            f'blockflow_tmq_pool_waits_total{{model="b0",model_instance="b0_0"}} {waits}',
            "# TYPE nv_inference_count counter",
            'nv_inference_count{model="b0",version="1"} 7', ""])

    before, after = counters_of(text(10, 2, 1)), counters_of(text(110, 6, 4))
    assert after == {"b1": {"link_samples": 110, "link_batches": 6}, "b0": {"pool_waits": 4}}
    rows = {r["block"]: r for r in block_breakdown({"b0": {"inferences": 8, "executions": 2}}, ["b0", "b1"], 1,
                                                   delta(after, before))}
    assert rows["b1"]["link_samples_per_batch"] == 25.0 and rows["b1"]["batch_per_execution"] == 0
    assert rows["b0"]["pool_waits"] == 3 and rows["b0"]["batch_per_execution"] == 4 and "link_samples_per_batch" not in rows["b0"]
