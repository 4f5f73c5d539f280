"""Each block of a task's path alone against the whole network (``blockflow.bench.lab.blocks_alone``),
run eagerly on the CPU as it runs on a GPU with CUDA graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockflow.bench import gpu_alone
from blockflow.bench.lab import blocks_alone

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "tests" / "plans" / "r18_three_cuts.yaml"


@pytest.fixture(autouse=True)
def few_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_alone, "REPLAYS", {1: 2})
    monkeypatch.setattr(gpu_alone, "OTHER_REPLAYS", 2)
    monkeypatch.setattr(gpu_alone, "WARM_S", 0.0)


def test_each_block_of_the_path_and_their_sum_are_set_against_the_whole_network(tmp_path: Path) -> None:
    blocks_alone.main(["--plan", str(PLAN), "--task", "t18_two", "--sizes", "2,1", "--device", "cpu", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "blocks_alone.json").read_text())
    assert res["path"] == ["r18_a", "r18_b", "r18_c2"] and list(res["blocks"]) == res["path"] and res["sizes"] == [1, 2]
    for b in ("1", "2"):
        assert res["sum"][b] == pytest.approx(sum(ms[b] for ms in res["blocks"].values()))
        assert res["sum_over_whole"][b] == pytest.approx(res["sum"][b] / res["whole"][b]) and res["whole"][b] > 0
    md = (tmp_path / "blocks_alone.md").read_text()
    assert "| r18_b | " in md and "| sum / whole | " in md and "--task t18_two --sizes 2,1 --device cpu" in md


@pytest.mark.parametrize("sizes", ["0", "8,x", ""])
def test_sizes_must_be_batch_sizes(sizes: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        blocks_alone.main(["--plan", str(PLAN), "--sizes", sizes, "--device", "cpu", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "--sizes" in capsys.readouterr().err


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no GPU visible to torch"):
        blocks_alone.measure(PLAN, None, None, (1,))
