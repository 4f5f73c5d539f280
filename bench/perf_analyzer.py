"""perf_analyzer runs: one closed-loop or Poisson point, and several runs of a point as one figure."""

from __future__ import annotations

import base64
import csv
import json
import math
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blockflow.clients.images import padded_files, random_jpegs
from blockflow.core.errors import EnvironmentProblem
from blockflow.core.spec import SideInput
from blockflow.triton.doctor import perf_analyzer_path
from blockflow.triton.install import perf_analyzer_env, perf_analyzer_shm_key
from blockflow.triton.process_group import run_child

INPUTS = ("host", "cuda-shm", "system-shm")
FIGURES = ("p50_ms", "p99_ms", "avg_ms", "throughput")  # what is repeated and reported as median and spread
FAILURE_LINES = 30  # of a failed run's output kept in its results (a Python block's traceback fits)
# Real photographs for tasks that take encoded images (README.md there names their sources; the wheel
# ships them as package data).
SAMPLE_IMAGES = Path(__file__).resolve().parent / "data" / "images"


def encoded_input_data(dest: Path, files: Sequence[Path] | None = None, sides: Sequence[SideInput] = ()) -> Path:
    """perf_analyzer's ``--input-data`` JSON at ``dest`` for a task that takes encoded images: one
    request's image per file (``files``, else the sample JPEGs; where those are missing, seeded random
    ones), sent in turn. Each is the uint8 tensor's raw bytes (``b64``) with its shape, ``[L]``: every
    file zero-padded to the longest, so that a batch of any of them (perf_analyzer's ``-b``, which
    stacks consecutive entries) is one ``[B, L]`` tensor; the task ignores the padding. Each entry
    gives the task's side inputs (``sides``) too, every one a sample of ones (perf_analyzer wants
    every input's data from the file once it reads one; ones, not zeros: a network may divide by them)."""
    images = [f.read_bytes() for f in (files if files is not None else sorted(SAMPLE_IMAGES.glob("*.jpg")))]
    rows = padded_files(images) if images else random_jpegs(4)
    ones = {s.name: {"content": [1.0 if s.dtype == "fp32" else 1] * math.prod(s.shape), "shape": list(s.shape)} for s in sides}
    data = [{"IMAGE": {"b64": base64.b64encode(row.tobytes()).decode(), "shape": [len(row)]}, **ones} for row in rows]
    dest.write_text(json.dumps({"data": data}))
    return dest


def side_input_data(dest: Path, image_shape: Sequence[int], uint8: bool, sides: Sequence[SideInput]) -> Path:
    """perf_analyzer's ``--input-data`` directory at ``dest`` for a task that takes side inputs: a file per
    input, named as it, holding one sample's raw bytes: a seeded random image (uint8 or float32, of the
    task's per-sample shape) and ones for each side input (random int64 would be no valid size)."""
    import numpy as np

    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, tuple(image_shape), dtype=np.uint8) if uint8 else rng.standard_normal(tuple(image_shape), dtype=np.float32)
    (dest / "IMAGE").write_bytes(image.tobytes())
    for s in sides:
        (dest / s.name).write_bytes(np.ones(s.shape, dtype=np.int64 if s.dtype == "int64" else np.float32).tobytes())
    return dest


def load_args(concurrency: int | None, rate: float | None, client_threads: int = 0) -> list[str]:
    """perf_analyzer's load options: Poisson arrivals at ``rate``/s, else a closed loop of ``concurrency``
    requests in flight. That loop runs in perf_analyzer's synchronous mode, a thread per request in flight,
    unless ``client_threads`` > 0: then asynchronously on that many threads. A client on the server's host
    takes its CPU from the server: at c256 and c512 the synchronous loop took up to 1.3-6.2 ms of CPU per
    inference, its start counted (docs/benchmarking.md, "Like with like")."""
    if rate is not None:
        # perf_analyzer sends a rate's requests from a few threads by default, which caps what it can
        # offer at a few hundred requests/s (seen on an H100); give it enough to keep the schedule.
        return ["--request-rate-range", f"{rate:.3f}", "--request-distribution", "poisson", "--max-threads", "64"]
    loop = ["--concurrency-range", str(concurrency or 1)]
    return [*loop, "--async", "--max-threads", str(client_threads)] if client_threads > 0 else loop


def perf_analyzer(url: str, model: str, shape: str | None, batch: int, seconds: float, concurrency: int | None = None,
                  rate: float | None = None, input_memory: str = "host", output_bytes: int = 0,
                  shm_key_file: Path | None = None, input_data: Path | None = None, client_threads: int = 0) -> dict[str, Any]:
    """One perf_analyzer run (closed loop at ``concurrency`` or Poisson arrivals at ``rate``/s).

    ``input_memory="cuda-shm"`` (``"system-shm"``): inputs and outputs through CUDA (system) shared-memory
    regions (perf_analyzer's ``--shared-memory cuda|system``), each output's region ``output_bytes`` large,
    registered with the key in ``shm_key_file`` (the server's ``shm_key_file``). ``input_data``: the
    requests' data (perf_analyzer's ``--input-data`` JSON, :func:`encoded_input_data`), else random.
    ``shape``: the image's (``IMAGE:3,224,224``); None where ``input_data`` gives each entry's.
    ``client_threads``: see :func:`load_args`.
    """
    pa = perf_analyzer_path()
    if pa is None:
        raise EnvironmentProblem("perf_analyzer not found: run ./scripts/setup.sh (or source scripts/gpu_env.sh on a GPU machine)")
    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        cmd = [pa, "-m", model, "-u", url, "-i", "http", *(["--shape", shape] if shape else []), "-b", str(batch),
               "--percentile", "50", "-f", f.name]
        if input_data is not None:
            cmd += ["--input-data", str(input_data)]
        if input_memory in ("cuda-shm", "system-shm"):
            cmd += ["--shared-memory", input_memory.removesuffix("-shm"), "--output-shared-memory-size", str(max(output_bytes, 102400))]
        env = perf_analyzer_env()
        if input_memory != "host":
            if shm_key_file is None:
                raise ValueError("shared-memory inputs need the server's shm_key_file")
            cmd, env = perf_analyzer_shm_key(cmd, env, shm_key_file)
        cmd += load_args(concurrency, rate, client_threads)
        timed = ["--measurement-interval", str(int(seconds * 1000)), "--max-trials", "4", "--stability-percentage", "20"]
        res = run_child(cmd + timed, capture_output=True, timeout=600, check=False, env=env)
        unstable = res.returncode != 0 and "stable" in (res.stdout + res.stderr)
        if unstable:
            # A busy or noisy machine: take the windows as they are, and say so in the results. Windows
            # of a count of requests, not of time: on a 2-core CI machine a time window of slow CPU
            # requests could end with none answered, which no stability percentage accepts.
            count = ["--measurement-mode", "count_windows", "--measurement-request-count", "16", "--max-trials", "4",
                     "--stability-percentage", "1000"]
            res = run_child(cmd + count, capture_output=True, timeout=600, check=False, env=env)
        if res.returncode != 0:
            return failure(res.stdout, res.stderr)  # perf_analyzer says what failed on either
        rows = list(csv.DictReader(open(f.name)))
    if not rows:
        return {"error": 1.0}
    row = rows[0]
    parts = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
             "Server Compute Infer", "Server Compute Output", "Client Recv")
    return {"throughput": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3, "avg_ms": sum(float(row[p]) for p in parts if p in row) / 1e3,
            **({"unstable": 1.0} if unstable else {})}


def failure(*outputs: str) -> dict[str, Any]:
    """A failed run from its ``outputs`` (stdout, stderr): ``message``, the line that says what failed
    (perf_analyzer's first error line in either, else the last line), and ``detail``, the last lines,
    which hold the server's traceback when a block raised (the last line alone is a frame of it)."""
    lines = [line for text in outputs for line in text.strip().splitlines() if line.strip()] or ["?"]
    said = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()
    return {"error": 1.0, "message": said[:500], "detail": "\n".join(lines[-FAILURE_LINES:])[-4000:]}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several perf_analyzer runs of one point as one: each figure's median, its spread
    ((max - min) / median) and the runs themselves; an error if any run failed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    out: dict[str, Any] = {}
    for key in FIGURES:
        values = sorted(r[key] for r in runs if key in r)
        if values:
            mid = statistics.median(values)
            out[key] = mid
            out.setdefault("spread", {})[key] = (values[-1] - values[0]) / mid if mid else 0.0
    if any("unstable" in r for r in runs):
        out["unstable"] = 1.0
    out["runs"] = [{k: r[k] for k in FIGURES if k in r} for r in runs]
    return out
