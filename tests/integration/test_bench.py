"""`blockflow bench --quick` runs end to end against a real server and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_writes_results_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = subprocess.run([sys.executable, "-m", "blockflow", "bench", "--quick", "--plan", "tests/plans/fused.yaml", "--out", str(out),
                          "--sections", "batch,concurrency,rate", "--repeats", "1",
                          # perf_analyzer's shortest window (the CLI's floor): every section and point still measured,
                          # each in half the time of --quick's 1 s; what is checked below holds for any window.
                          "--seconds", "0.5"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["complete"] is True and not (out / "results.json.tmp").exists()
    assert set(results["models"]) == {"monolithic-eager", "tensormq", "triton-cpu"}
    meta = results["meta"]
    assert (meta["precision"], meta["reference_precision"], meta["input"], meta["mps"], meta["repeats"]) == ("fp32", "fp32", "host", False, 1)
    for label in results["models"]:
        r = results["pipeline"][label]
        assert "error" not in r, (label, r)
        assert r["p50_ms"] > 0 and r["throughput"] > 0
        assert [x["p50_ms"] for x in r["runs"]] == [r["p50_ms"]] and r["spread"]["p50_ms"] == 0  # several runs: test_bench_stats
    assert [b["block"] for b in results["pipeline"]["tensormq"]["blocks"]] == ["trunk0__to__trunk1", "h1_a__to__h1_b"]
    assert set(results["concurrency"]["tensormq"]) == {"1", "4"} and set(results["rate"]["tensormq"]) == {"0.5", "1"}
    # The host's CPU per inference: the split's block processes did work, and so did Triton and the client.
    cpu = results["concurrency"]["tensormq"]["4"]["host_cpu_ms_per_inference"]
    assert {"trunk0__to__trunk1", "h1_a__to__h1_b"} <= set(cpu["blocks"]) and cpu["blocks"]["trunk0__to__trunk1"] > 0
    assert cpu["server"] > 0 and cpu["client"] > 0 and cpu["total"] >= sum(cpu["blocks"].values())
    assert cpu["own_blocks"] == round(cpu["blocks"]["trunk0__to__trunk1"] + cpu["blocks"]["h1_a__to__h1_b"], 4)
    report = (out / "report.md").read_text()
    assert "blocks and monolithic references in **fp32**" in report and "median of 1 perf_analyzer run(s)" in report
    for transport in ("tensormq", "triton-cpu"):
        assert f"| {transport} |" in report.split("## The split against the unsplit model (monolithic-eager")[1].split("##")[0]
    for heading in ("Pipeline time (Fig 4.3)", "Batch scaling (Fig 4.7)", "Concurrency (Fig 4.11)", "Offered load (Fig 4.12)",
                    "Host CPU per inference"):
        assert heading in report
    for png in ("fig4_3_pipeline.png", "fig4_4_breakdown.png", "fig4_7_batch.png", "fig4_11_clients.png", "fig4_12_offered_load.png"):
        assert (out / png).stat().st_size > 5000, png
