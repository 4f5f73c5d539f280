"""Pure logic of live updates: the difference between a plan and what a server runs, and the load order."""

from __future__ import annotations

import threading
from pathlib import Path

from blockflow.control.apply import (
    Applier,
    Change,
    Report,
    Served,
    compute_diff,
    ensembles_first,
    expected_instances,
    handed_inputs,
)
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import DIGEST_PARAMETER, parse_pbtxt
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
A = load_plan(ROOT / "tests" / "plans" / "live_a.yaml")
B = load_plan(ROOT / "tests" / "plans" / "live_b.yaml")


def _served(plan_files: dict[str, bytes]) -> list[Served]:
    out = []
    for name, files in generator.by_model(plan_files).items():
        cfg = parse_pbtxt(files["config.pbtxt"].decode())
        out.append(Served(name, cfg.platform == "ensemble", cfg.parameters[DIGEST_PARAMETER].string_value))
    return out


def test_same_plan_is_no_change() -> None:
    files = generator.render(A)
    d = compute_diff(files, _served(files))
    assert d.empty and d.lines()[0].startswith("no change") and len(d.unchanged) == 7


def test_a_to_b_in_order_blocks_then_ensembles_then_removals() -> None:
    d = compute_diff(generator.render(B), _served(generator.render(A)) + [Served("someone_elses", False, None)])
    assert [str(c) for c in d.changes] == [
        "+ block head_new", "+ block head_swap_b", "~ block head_keep", "+ ensemble new", "~ ensemble swap",
        "- ensemble gone", "- block head_gone", "- block head_swap_a"]
    assert d.unchanged == ("keep", "trunk") and d.foreign == ("someone_elses",)


def test_digest_follows_weights_file_contents(tmp_path: Path) -> None:
    from blockflow.plan import parse_plan

    w = tmp_path / "w.pt"
    import torch

    torch.save({}, w)
    raw = A.raw.model_dump(mode="json", exclude_none=True)
    raw["blocks"]["head_keep"]["weights"] = {"file": str(w)}
    before = generator.render(parse_plan(raw, base_dir=tmp_path))
    torch.save({"x": torch.zeros(1)}, w)
    after = generator.render(parse_plan(raw, base_dir=tmp_path))
    assert [str(c) for c in compute_diff(after, _served(before)).changes] == ["~ block head_keep"]


def test_expected_instances_per_device() -> None:
    files = generator.render(B)
    assert expected_instances(files, gpus=0) == {"trunk": 1, "head_keep": 2, "head_swap_b": 1, "head_new": 1}
    assert expected_instances(files, gpus=2)["head_keep"] == 4  # placement auto: each GPU gets the instances


class _Recorder(Applier):
    """The applier's ordering with the server calls recorded instead of sent (pure logic)."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        self.lock = threading.Lock()
        self._log = lambda _m: None
        self.waves: list[list[str]] = []
        self.on_disk: dict[str, bool] = {}

    def _load_all(self, changes: list[Change], report: Report) -> None:
        self.waves.append(sorted(c.model for c in changes))
        for c in changes:
            self.on_disk[c.model] = (self.repository / c.model / "config.pbtxt").is_file()


def test_load_waves_respect_dependencies(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    generator.write(generator.render(A), repo)
    rec = _Recorder(repo)
    files = generator.render(B)
    wanted = generator.by_model(files)
    d = compute_diff(files, _served(generator.render(A)))
    blocks = [c for c in d.changes if not c.ensemble and c.action != "remove"]
    ensembles = [c for c in d.changes if c.ensemble and c.action != "remove"]
    done: list[Change] = []
    old_swap = (repo / "swap" / "config.pbtxt").read_bytes()

    def recording(changes: list[Change], report: Report) -> None:
        _Recorder._load_all(rec, changes, report)
        if len(rec.waves) == 1:  # while blocks load, ensembles still name the old blocks on disk
            assert (repo / "swap" / "config.pbtxt").read_bytes() == old_swap

    rec._load_all = recording  # type: ignore[method-assign]
    rec._load_waves(blocks, ensembles, wanted, done, Report(d))
    # Every new and changed block at once, then the ensembles (whose blocks are all loaded by then).
    assert rec.waves == [["head_keep", "head_new", "head_swap_b"], ["new", "swap"]]
    assert all(rec.on_disk.values()) and {c.model for c in done} == set(rec.waves[0]) | set(rec.waves[1])


def _hand_over_plans() -> dict[str, dict[str, bytes]]:
    """tests/plans/hand_over.yaml rendered with hand_over direct and ensemble (its references and compare
    variants left out)."""
    import yaml

    from blockflow.plan import parse_plan

    raw = yaml.safe_load((ROOT / "tests" / "plans" / "hand_over.yaml").read_text())
    out = {}
    for mode in ("direct", "ensemble"):
        plan = parse_plan({**raw, "hand_over": mode, "compare": [], "references": []}, source=mode, base_dir=ROOT)
        out[mode] = generator.render(plan)
    return out


def test_an_ensemble_that_stops_handing_over_loads_before_its_blocks(tmp_path: Path) -> None:
    plans = _hand_over_plans()
    direct, chain = generator.by_model(plans["direct"]), generator.by_model(plans["ensemble"])
    assert handed_inputs(parse_pbtxt(direct["task_a"]["config.pbtxt"].decode())) == {("head_a", "HANDED_AFTER_0"), ("head_a", "HANDED_AFTER_1")}
    assert handed_inputs(parse_pbtxt(chain["task_a"]["config.pbtxt"].decode())) == frozenset()
    # direct -> ensemble: both tasks' ensembles first, then every block whose part changed.
    d = compute_diff(plans["ensemble"], _served(plans["direct"]))
    ensembles = [c for c in d.changes if c.ensemble]
    assert ensembles_first(ensembles, direct, chain, _served(plans["direct"])) == ensembles
    repo = tmp_path / "repo"
    generator.write(plans["direct"], repo)
    rec = _Recorder(repo)
    blocks = [c for c in d.changes if not c.ensemble]
    rec._load_waves(blocks, ensembles, chain, [], Report(d), ensembles_first(ensembles, direct, chain, _served(plans["direct"])))
    assert rec.waves == [["task_a", "task_b"], sorted(c.model for c in blocks), []]
    assert {"mid_a", "mid_b", "mid_c", "head_a", "head_b"} <= set(rec.waves[1])
    # ensemble -> direct: the blocks first, as for any change.
    d = compute_diff(plans["direct"], _served(plans["ensemble"]))
    assert ensembles_first([c for c in d.changes if c.ensemble], chain, direct, _served(plans["ensemble"])) == []
    # An ensemble whose new steps name a block the server does not run yet waits for the block wave.
    assert ensembles_first(ensembles, direct, chain, [s for s in _served(plans["direct"]) if s.name != "mid_b"]) == []
