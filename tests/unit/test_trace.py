"""backend/trace.py: a traced call's line, written off the call by the tracer's own thread."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from blockflow.backend import trace
from blockflow.backend.trace import Tracer


def _calls(tracer: Tracer | trace.NoTracer, n: int) -> None:
    for i in range(n):
        tracer.begin()
        tracer.lap("read:input")
        tracer.mark()
        tracer.gpu_begin()
        tracer.mark()
        tracer.end(i + 1)


def _lines(directory: Path) -> list[dict[str, object]]:
    (path,) = directory.glob("m.m_0.*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_call_is_one_line_in_call_order_once_closed(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path, "m", "m_0", torch.device("cpu"))
    _calls(tracer, 50)
    tracer.close()
    lines = _lines(tmp_path)
    assert [r["n"] for r in lines] == list(range(1, 51))
    for r in lines:
        t = r["t"]
        assert isinstance(t, list) and len(t) == 4 and t == sorted(t)
        assert r["laps"][0][0] == "read:input" and t[0] <= r["laps"][0][1] <= t[1]  # type: ignore[index]
        assert "gpu_ms" not in r


def test_lines_land_while_the_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "FLUSH_S", 0.02)
    tracer = Tracer(tmp_path, "m", "m_0", torch.device("cpu"))
    try:
        _calls(tracer, 3)
        deadline = time.monotonic() + 5
        while len(_lines(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(_lines(tmp_path)) == 3
    finally:
        tracer.close()


def test_an_untraced_block_gets_a_tracer_that_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace.ENV, raising=False)
    untraced = trace.tracer_for("m", "m_0", torch.device("cpu"))
    assert isinstance(untraced, trace.NoTracer) and untraced.part_lap is None
    untraced.start()
    _calls(untraced, 3)
    untraced.close()
    monkeypatch.setenv(trace.ENV, str(tmp_path / "traces"))
    traced = trace.tracer_for("m", "m_0", torch.device("cpu"))
    assert isinstance(traced, Tracer) and traced.part_lap is not None
    traced.start()
    traced.close()
    assert [r["step"] for r in _lines(tmp_path / "traces")] == ["start"]


def test_the_no_op_tracer_has_every_step_of_the_tracer() -> None:
    public = {n for n in vars(Tracer) if not n.startswith("_")}
    assert public <= {n for n in vars(trace.NoTracer) if not n.startswith("_")}
