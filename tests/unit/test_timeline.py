"""bench.timeline's request anatomy, from hand-made trace records and two turns' timelines under tests/fixtures/results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from blockflow.bench.harness import switches
from blockflow.bench.lab import traced_turns
from blockflow.bench.timeline import anatomy, step_order, write_report


def _exec(t: list[int], laps: list[tuple[str, int]] | None = None) -> dict[str, object]:
    return {"kind": "execute", "t": t, "laps": laps or []}


def test_a_hop_starts_where_the_block_answered() -> None:
    """A block that answered with its tickets before queuing its work (a *run:reply* lap) hands on
    from that lap, not from its return; the next block may enter before that return."""
    traces = {"a": [_exec([100_000, 110_000, 300_000, 310_000], [("run:reserve", 120_000), ("run:reply", 150_000)])],
              "b": [_exec([250_000, 260_000, 400_000, 410_000])],
              "c": [_exec([600_000, 610_000, 700_000, 710_000])]}
    res = anatomy([(0, 800_000)], ["a", "b", "c"], traces)
    m = res["median_ms"]
    assert res["matched"] == 1
    assert m["a.hop"] == 0.1  # 150 us (reply) -> 250 us (b's entry)
    assert m["b.hop"] == 0.19  # no early answer: b's return -> c's entry
    assert m["a.run:reply"] == 0.03 and m["a.execute"] == 0.21 and m["last_to_client"] == 0.09


def test_a_chains_join_entered_before_the_hand_over_hops_from_it_to_its_decode() -> None:
    """A join the ensemble called before the last link handed over: its hop ends where its read:decode
    (the wait for the hand-over) ended, not at its entry, which came first."""
    traces = {"a": [_exec([100_000, 110_000, 300_000, 310_000], [("run:reply", 150_000)])],
              "j": [_exec([120_000, 400_000, 500_000, 510_000], [("read:input", 130_000), ("read:decode", 380_000)])]}
    m = anatomy([(0, 600_000)], ["a", "j"], traces)["median_ms"]
    assert m["a.hop"] == 0.23  # 150 us (sent) -> 380 us (the join got it)
    traces["j"] = [_exec([120_000, 130_000, 500_000, 510_000], [("read:decode", 125_000)])]  # got its input before
    assert anatomy([(0, 600_000)], ["a", "j"], traces)["median_ms"]["a.hop"] == -0.03


RESULTS = Path(__file__).resolve().parents[1] / "fixtures" / "results" / "h100" / "side_thread_ab-2026-11-27-f716af3" / "timeline"


def test_the_report_lists_each_block_s_steps_in_request_order(tmp_path: Path) -> None:
    res = json.loads((RESULTS / "1_0" / "timeline.json").read_text())
    write_report(res, tmp_path / "timeline.md")
    rows = [ln.split(" | ")[0][2:] for ln in (tmp_path / "timeline.md").read_text().splitlines() if ln.startswith("| b1.")]
    assert rows[:7] == ["b1.read", "b1.read:input", "b1.read:decode", "b1.read:claim", "b1.read:wait", "b1.read:gather", "b1.run"]
    assert rows[-4:] == ["b1.respond", "b1.execute", "b1.gpu", "b1.hop"]
    assert step_order(["b0"], {"end_to_end": 1.0, "b0.read": 0.1, "b0.run:reply": 0.1, "b0.run": 0.2}) == \
        ["b0.read", "b0.run", "b0.run:reply", "end_to_end"]


def test_a_result_records_the_behaviour_switches_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKFLOW_TMQ_EARLY", "0")
    monkeypatch.setenv("BLOCKFLOW_TOKEN", "secret")  # not a switch: never recorded
    monkeypatch.delenv("BLOCKFLOW_TMQ_PREPARE", raising=False)
    assert switches() == {"BLOCKFLOW_TMQ_EARLY": "0"}
    res = {**json.loads((RESULTS / "1_0" / "timeline.json").read_text()), "switches": switches()}
    write_report(res, tmp_path / "timeline.md")
    assert "; `BLOCKFLOW_TMQ_EARLY=0`; " in (tmp_path / "timeline.md").read_text()


@pytest.mark.parametrize(("mps", "said"), [(None, "MPS off"), (False, "MPS off"), (True, "MPS on")])
def test_the_report_says_whether_the_server_ran_under_mps(tmp_path: Path, mps: bool | None, said: str) -> None:
    res = json.loads((RESULTS / "1_0" / "timeline.json").read_text())  # traces before --mps record none: off
    if mps is not None:
        res["mps"] = mps
    write_report(res, tmp_path / "timeline.md")
    assert f"; {said}; " in (tmp_path / "timeline.md").read_text()


def test_traced_turns_put_each_turn_s_steps_side_by_side(tmp_path: Path) -> None:
    for name in ("1_0", "2_1"):  # two turns of this setting that finished; the third never did
        (tmp_path / name).mkdir()
        shutil.copy(RESULTS / name / "timeline.json", tmp_path / name / "timeline.json")
    md = traced_turns.summary(tmp_path, "X", ["0", "1", "0"], ["--warm-cores-ms", "50"])
    assert "a fresh server per turn (every one with `--warm-cores-ms 50`)" in md
    assert "| turn | monolithic-graph end to end | tensormq end to end | tensormq − monolithic-graph |" in md
    assert "| 1 X=0 | 2.077 ms | 3.486 ms | 1.409 ms |" in md
    assert "| 3 X=0 | not finished |" in md
    assert "| step | 1 X=0 | 2 X=1 |" in md
    assert "| b1.read:claim | 153 | 28 |" in md  # the step that setting moved
    assert "| b1.run:checks | 4 | — |" in md  # a step one turn lacks
    assert md.index("| b0.run:reply |") < md.index("| b0.hop |") < md.index("| b1.read |")
    assert "No turn has finished yet." in traced_turns.summary(tmp_path / "none", "X", ["0"])
