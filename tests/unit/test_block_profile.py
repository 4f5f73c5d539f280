"""py-spy's collapsed stacks added up by block (bench/lab/block_profile.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from blockflow.bench.lab import block_profile


def test_samples_split_into_the_stubs_threads_execute_and_other_python_threads(tmp_path: Path) -> None:
    (tmp_path / "pids.txt").write_text("100 7 b1\n100 8 b1\n200 7 b1\n100 9 b2\n")
    (tmp_path / "100-7.txt").write_text(
        " 30\n"  # a thread with no Python frame: the stub's own
        "TritonPythonModel.execute (model.py:127);RequestInputs.read (request_inputs.py:112) 50\n"
        "Thread._bootstrap (threading.py:1030);Consumer._release_loop (consumer.py:319) 10\n")
    (tmp_path / "100-8.txt").write_text("Thread._bootstrap (threading.py:1030);Producer._serve (producer.py:262) 10\n")
    (tmp_path / "200-7.txt").write_text(" 999\n")  # another window: left out
    (tmp_path / "100-9.txt").write_text(" 5\n")
    text = block_profile.summary(tmp_path, {"100"}, top=2)
    assert "## b1: 100 samples\n\nexecute 50%, stub's own threads 30%, other Python threads 20%\n" in text
    assert "- 50.0% RequestInputs.read (request_inputs.py:112)\n- 30.0% (no Python frame)\n" in text
    assert "## b2: 5 samples\n\nstub's own threads 100%\n" in text
    assert block_profile.recorded_windows(tmp_path) == {"100", "200"}
    assert "## b1: 1099 samples" in block_profile.summary(tmp_path, block_profile.recorded_windows(tmp_path), top=2)


def test_a_stub_process_is_found_with_its_model(tmp_path: Path) -> None:
    # A process started as Triton starts a stub: an executable of the stub's name, its model file first.
    stub = tmp_path / "triton_python_backend_stub"
    shutil.copy(os.path.realpath(sys.executable), stub)
    model = tmp_path / "repo" / "r50__ref_graph" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    model.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([str(stub), str(model), "triton_python_backend_shm_region_1", "1048576"])
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in (found := block_profile.stub_models()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found[proc.pid] == "r50__ref_graph"
        assert os.getpid() not in found
    finally:
        proc.kill()
        proc.wait()
