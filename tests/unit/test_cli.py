"""The command line: useful output, and one clear line (no traceback) for every expected mistake."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def blockflow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, check=False)


def one_line_error(res: subprocess.CompletedProcess[str], code: int, fragment: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert fragment in lines[0], lines[0]


def test_validate_and_show_default_plan() -> None:
    res = blockflow("validate", "plans/default.yaml")
    assert res.returncode == 0 and "1 model(s), 8 block(s), 4 task(s)" in res.stdout
    res = blockflow("show", "plans/default.yaml")
    assert res.returncode == 0, res.stderr
    for text in ("cls_a, cls_b, det_c", "r50_s0 → r50_s1 → r50_s2 → r50_s3a", "256×56×56", "3.06 MiB"):
        assert text in res.stdout, text


def test_load_with_cuda_inputs_on_a_machine_without_a_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; tests/gpu loads through CUDA regions")
    # Refused before any server is asked: nothing listens on port 1.
    one_line_error(blockflow("load", "--task", "t", "--url", "127.0.0.1:1", "--input", "cuda"), 2, "--input cuda needs a CUDA GPU")


def test_validate_reports_every_problem(tmp_path: Path) -> None:
    plan = tmp_path / "p.yaml"
    text = (ROOT / "plans" / "default.yaml").read_text()
    plan.write_text(text.replace("instances: 1", "instances: 0").replace("precision: fp32", "precision: fp64"))
    res = blockflow("validate", str(plan))
    assert res.returncode == 7 and "Traceback" not in res.stderr  # 7: an invalid plan (2 is click's, for usage)
    assert "defaults.instances" in res.stderr and "defaults.precision" in res.stderr
    # Graph problems are checked once every field is valid, and reported together too.
    plan.write_text(text.replace("r50_s2c, r50_s3c", "r50_s3c, r50_s2c").replace("r50_s2, r50_s3b", "r50_s3b, r50_s2"))
    res = blockflow("validate", str(plan))
    assert res.returncode == 7
    assert "tasks.det_c.path[2]" in res.stderr and "tasks.cls_b.path[2]" in res.stderr


def test_missing_plan_file_is_one_line() -> None:
    one_line_error(blockflow("serve", "--plan", "nope.yaml"), 7, "plan file not found: nope.yaml")
    one_line_error(blockflow("validate", "nope.yaml"), 7, "plan file not found")


def test_malformed_command_lines_are_one_line() -> None:
    one_line_error(blockflow("serve", "--bogus"), 2, "No such option '--bogus'")
    one_line_error(blockflow("serve", "--http-port", "99999"), 2, "--http-port")
    one_line_error(blockflow("infer"), 2, "Missing argument 'TASK'")
    one_line_error(blockflow("infer", "cls_a"), 2, "give exactly one of --image FILE or --random")
    one_line_error(blockflow("infer", "cls_a", "--random", "--protocol", "udp"), 2, "--protocol")
    one_line_error(blockflow("frobnicate"), 2, "No such command 'frobnicate'")
    one_line_error(blockflow("apply", "plans/default.yaml", "--soak", "5"), 2, "--soak watches the servers of a fleet")
    one_line_error(blockflow("apply", "plans/default.yaml", "--fleet", "http://127.0.0.1:1", "--soak", "-1"), 2, "--soak")


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = blockflow("serve", "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0")
    assert res.returncode == 4
    assert "Traceback" not in res.stderr
    assert f"HTTP port {port} on 127.0.0.1 is already in use" in res.stderr
    # serve's progress is logged with its time and level, one line each; --log-level hides it.
    assert re.search(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S* INFO +starting tritonserver with \d+ models", res.stderr, re.M), res.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        quiet = blockflow("--log-level", "warning", "serve", "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0")
    assert quiet.returncode == 4 and "starting tritonserver" not in quiet.stderr and "already in use" in quiet.stderr


def test_unreachable_server_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = blockflow("infer", "cls_a", "--random", "--url", f"127.0.0.1:{port}")
    assert res.returncode == 8 and "Traceback" not in res.stderr  # 8: a server did not answer
    assert "cannot reach the server" in res.stderr


def test_generate_check_detects_stale_repository(tmp_path: Path) -> None:
    assert blockflow("generate", "plans/default.yaml", "-o", "model_repository", "--check").returncode == 0
    repo = tmp_path / "repo"
    assert blockflow("generate", "plans/default.yaml", "-o", str(repo)).returncode == 0
    (repo / "cls_a" / "config.pbtxt").write_text("max_batch_size: 3\n")
    res = blockflow("generate", "plans/default.yaml", "-o", str(repo), "--check")
    assert res.returncode == 1 and "differs: cls_a/config.pbtxt" in res.stderr


def test_doctor_runs() -> None:
    res = blockflow("doctor")
    assert "tritonserver" in res.stdout and "Python-backend stub" in res.stdout
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["--version"]])
def test_help(argv: list[str]) -> None:
    res = blockflow(*argv)
    assert res.returncode == 0 and res.stdout


def test_serve_refuses_a_gpu_placement_without_gpus(tmp_path: Path) -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
        pytest.skip("this machine has GPUs")
    except pynvml.NVMLError:
        pass
    plan = tmp_path / "p.yaml"
    plan.write_text((ROOT / "plans" / "default.yaml").read_text().replace("placement: auto", "placement: [3]"))
    res = blockflow("serve", "--plan", str(plan), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0")
    assert res.returncode == 7 and "Traceback" not in res.stderr
    assert "GPU 3 does not exist" in res.stderr


def test_serve_suggests_mps_only_when_many_processes_share_a_gpu() -> None:
    from blockflow.control.serve import MPS_HINT_PROCESSES, mps_hint
    from blockflow.ensemble_gen.rendered import render
    from blockflow.plan import load_plan, memory

    many = render(memory.scenario_plan("resnet50", 20, memory.SCENARIOS[2], fuse=True))  # 22 processes on GPU 0
    assert "22 block processes share GPU 0" in mps_hint(many, 1) and "--mps" in mps_hint(many, 1)
    packed = memory.scenario_plan("resnet50", 20, memory.SCENARIOS[2], fuse=True, pack=True)  # 6 processes
    assert len(memory.modular(packed, 1, memory.Calibration())) < MPS_HINT_PROCESSES and mps_hint(render(packed), 1) == ""
    assert mps_hint(render(load_plan(ROOT / "plans" / "default.yaml")), 0) == ""  # placement auto on a CPU machine: no GPU


@pytest.mark.parametrize(("arg", "fragment"), [
    ("--tritonserver-arg=--http-restricted-api=model-repository:", "--http-restricted-api is set by BlockFlow"),
    ("--tritonserver-arg=--model-control-mode=poll", "--model-control-mode is set by BlockFlow"),
    ("--tritonserver-arg=--http-port=9", "use --http-port"),
    ("--tritonserver-arg=--model-control=poll", "--model-control-mode is set by BlockFlow"),  # getopt abbreviation
    ("--tritonserver-arg=log-verbose=1", "give it as --flag=value"),
])
def test_serve_refuses_tritonserver_args_that_blockflow_sets(arg: str, fragment: str) -> None:
    res = blockflow("serve", arg)
    assert res.returncode == 2 and "Traceback" not in res.stderr and fragment in res.stderr, res.stderr


def test_tritonserver_args_pass_through_and_replace_the_log_verbosity(tmp_path: Path) -> None:
    from blockflow.triton.server import ServerOptions, TritonServer

    server = TritonServer(ServerOptions([tmp_path], extra_args=["--log-verbose=1", "--trace-config=rate=100"]), runtime_dir=tmp_path)
    cmd = server.command()
    assert cmd[-2:] == ["--log-verbose=1", "--trace-config=rate=100"]
    assert [a for a in cmd if a.startswith("--log-verbose")] == ["--log-verbose=1"]
    assert any(a.startswith("--http-restricted-api=") for a in cmd)


def test_latency_summaries_are_off_unless_asked_for_and_then_keep_the_quantiles_status_reads(tmp_path: Path) -> None:
    from blockflow.triton.options import LATENCY_QUANTILES
    from blockflow.triton.server import ServerOptions, TritonServer

    assert not [a for a in TritonServer(ServerOptions([tmp_path]), runtime_dir=tmp_path).command() if a.startswith("--metrics-config")]
    on = [a for a in TritonServer(ServerOptions([tmp_path], latency_summaries=True), runtime_dir=tmp_path).command()
          if a.startswith("--metrics-config")]
    assert on == ["--metrics-config=summary_latencies=true", f"--metrics-config=summary_quantiles={LATENCY_QUANTILES}"]
    assert {q.split(":")[0] for q in LATENCY_QUANTILES.split(",")} == {"0.5", "0.99"}  # what blockflow status and the dashboard read
    mine = TritonServer(ServerOptions([tmp_path], latency_summaries=True, latency_quantiles="0.5:0.01"), runtime_dir=tmp_path).command()
    assert "--metrics-config=summary_quantiles=0.5:0.01" in mine


def test_json_output_of_the_commands_that_need_no_server(tmp_path: Path) -> None:
    """Each prints one document with the keys docs/cli-json.md lists."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    def doc(*args: str, code: int = 0) -> dict[str, object]:
        res = blockflow(*args, "--json")
        assert res.returncode == code, res.stderr
        parsed: dict[str, object] = json.loads(res.stdout)
        return parsed

    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "plans" / "default.yaml").read_text().replace("instances: 1", "instances: 0"))
    # Each command is a process that imports torch (~4 s): the independent ones run side by side.
    with ThreadPoolExecutor(4) as pool:
        valid = pool.submit(doc, "validate", "plans/default.yaml")
        invalid_f = pool.submit(doc, "validate", str(bad), code=7)
        shown_f = pool.submit(doc, "show", "tests/plans/skip_cut.yaml")
        cuts_f = pool.submit(doc, "show", "--cuts", "resnet18", "--input-shape", "3,32,32")
        memory_f = pool.submit(doc, "plan-memory", "plans/default.yaml", "--gpus", "1")
        generated = pool.submit(doc, "generate", "tests/plans/one_block.yaml", "-o", str(tmp_path / "repo"))
        checks_f = pool.submit(blockflow, "doctor", "--json")
    assert valid.result().keys() == {"plan", "valid", "models", "blocks", "tasks", "warnings"}
    invalid = invalid_f.result()
    assert invalid["valid"] is False and any(i["loc"] == "defaults.instances" for i in invalid["issues"])  # type: ignore[attr-defined]
    shown = shown_f.result()
    assert shown.keys() == {"plan", "tasks", "blocks"}
    assert {"task", "transports", "path", "shared_blocks", "hand_overs", "hops", "inputs", "outputs"} == set(shown["tasks"][0])  # type: ignore[index]
    cuts = cuts_f.result()
    assert cuts["networks"][0]["cuts"][0].keys() == {"cut", "tensors", "bytes_per_sample"}  # type: ignore[index]
    memory = memory_f.result()
    assert memory.keys() == {"plan", "calibration", "calibrated", "processes", "per_gpu"} and memory["calibrated"] is True
    assert generated.result()["models"] == ["only", "whole"]
    assert doc("generate", "tests/plans/one_block.yaml", "-o", str(tmp_path / "repo"), "--check")["up_to_date"] is True
    checks = checks_f.result()
    assert {"ok", "checks"} == json.loads(checks.stdout).keys()
    (key,) = [c for c in json.loads(checks.stdout)["checks"] if c["check"] == "admin key off the command line"]
    if shutil.which("cc") or shutil.which("gcc"):
        assert key["ok"] and key["detail"].startswith("yes (")
    else:  # refused, unless /proc hides other users' processes or the operator accepts it
        assert key["detail"].startswith("no: ") if key["ok"] else "every local user can read" in key["detail"]
