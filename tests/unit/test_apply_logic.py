"""Pure logic of live updates: the difference between a plan and what a server runs, and the load order."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blockflow.control.apply import Applier, Report, expected_instances, stand_in_note
from blockflow.control.diff import Change, Served, as_served, compute_diff
from blockflow.control.order import HandOverOrder, Widening, bridge, hand_over_order, hand_overs_changed, stand_ins, widening
from blockflow.core import also_accepts
from blockflow.core.also_accepts import AlsoAccepts
from blockflow.core.errors import ApplyError
from blockflow.ensemble_gen import generator, rendered
from blockflow.ensemble_gen.configs import DIGEST_PARAMETER, handed_pairs, parse_pbtxt, to_pbtxt, without_hand_overs
from blockflow.ensemble_gen.rendered import RenderedModel, RenderedRepository
from blockflow.plan import Plan, load_plan

ROOT = Path(__file__).resolve().parents[2]
A = load_plan(ROOT / "tests" / "plans" / "live_a.yaml")
B = load_plan(ROOT / "tests" / "plans" / "live_b.yaml")


_served = as_served  # a server that runs the rendered repository given


def test_same_plan_is_no_change() -> None:
    a = rendered.render(A)
    d = compute_diff(a, _served(a))
    assert d.empty and d.lines()[0].startswith("no change") and len(d.unchanged) == 7


def test_a_to_b_in_order_blocks_then_ensembles_then_removals() -> None:
    d = compute_diff(rendered.render(B), _served(rendered.render(A)) + [Served("someone_elses", False, None)])
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
    before = rendered.render(parse_plan(raw, base_dir=tmp_path))
    torch.save({"x": torch.zeros(1)}, w)
    after = rendered.render(parse_plan(raw, base_dir=tmp_path))
    assert [str(c) for c in compute_diff(after, _served(before)).changes] == ["~ block head_keep"]


def test_expected_instances_per_device() -> None:
    b = rendered.render(B)
    assert expected_instances(b, gpus=0) == {"trunk": 1, "head_keep": 2, "head_swap_b": 1, "head_new": 1}
    assert expected_instances(b, gpus=2)["head_keep"] == 4  # placement auto: each GPU gets the instances


class _Recorder(Applier):
    """The applier's ordering with the server calls recorded instead of sent (pure logic)."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        self.lock = threading.Lock()
        self._log = lambda _m: None
        self.waves: list[list[str]] = []
        self.on_disk: dict[str, bool] = {}

    def _load_all(self, changes: list[Change], report: Report, how: str = "") -> None:
        self.waves.append(sorted(c.model for c in changes))
        for c in changes:
            self.on_disk[c.model] = (self.repository / c.model / "config.pbtxt").is_file()


def test_load_waves_respect_dependencies(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    generator.write(rendered.render(A).files, repo)
    rec = _Recorder(repo)
    b = rendered.render(B)
    wanted = b.models
    d = compute_diff(b, _served(rendered.render(A)))
    blocks = [c for c in d.changes if not c.ensemble and c.action != "remove"]
    ensembles = [c for c in d.changes if c.ensemble and c.action != "remove"]
    done: list[Change] = []
    old_swap = (repo / "swap" / "config.pbtxt").read_bytes()

    def recording(changes: list[Change], report: Report, how: str = "") -> None:
        _Recorder._load_all(rec, changes, report)
        if len(rec.waves) == 1:  # while blocks load, ensembles still name the old blocks on disk
            assert (repo / "swap" / "config.pbtxt").read_bytes() == old_swap

    rec._load_all = recording  # type: ignore[method-assign]
    rec._load_waves(blocks, ensembles, wanted, done, Report(d))
    # Every new and changed block at once, then the ensembles (whose blocks are all loaded by then).
    assert rec.waves == [["head_keep", "head_new", "head_swap_b"], ["new", "swap"]]
    assert all(rec.on_disk.values()) and {c.model for c in done} == set(rec.waves[0]) | set(rec.waves[1])


def _hand_over_plans() -> dict[str, RenderedRepository]:
    """tests/plans/hand_over.yaml rendered with hand_over direct and ensemble (its references and compare
    variants left out)."""
    import yaml

    from blockflow.plan import parse_plan

    raw = yaml.safe_load((ROOT / "tests" / "plans" / "hand_over.yaml").read_text())
    out = {}
    for mode in ("direct", "ensemble"):
        plan = parse_plan({**raw, "hand_over": mode, "compare": [], "references": []}, source=mode, base_dir=ROOT)
        out[mode] = rendered.render(plan)
    return out


def _cfg(models: Mapping[str, RenderedModel], model: str) -> Any:
    """A copy of ``model``'s config, free to change."""
    return parse_pbtxt(models[model].files["config.pbtxt"].decode())


def test_an_ensemble_that_stops_handing_over_loads_before_its_blocks(tmp_path: Path) -> None:
    plans = _hand_over_plans()
    direct, chain = plans["direct"].models, plans["ensemble"].models
    assert handed_pairs(_cfg(direct, "task_a")) == {("mid_a", "mid_b"), ("mid_b", "mid_c")}
    assert handed_pairs(_cfg(chain, "task_a")) == frozenset()
    # direct -> ensemble: both tasks' ensembles first, then every block whose part changed.
    d = compute_diff(plans["ensemble"], _served(plans["direct"]))
    ensembles = [c for c in d.changes if c.ensemble]
    order = hand_over_order(ensembles, direct, chain, _served(plans["direct"]))
    assert order == HandOverOrder(first=tuple(ensembles))
    repo = tmp_path / "repo"
    generator.write(plans["direct"].files, repo)
    rec = _Recorder(repo)
    blocks = [c for c in d.changes if not c.ensemble]
    rec._load_waves(blocks, ensembles, chain, [], Report(d), order)
    assert rec.waves == [["task_a", "task_b"], sorted(c.model for c in blocks)]
    assert {"mid_a", "mid_b", "mid_c", "head_a", "head_b"} <= set(rec.waves[1])
    # ensemble -> direct: the blocks first, as for any change.
    d = compute_diff(plans["direct"], _served(plans["ensemble"]))
    assert hand_over_order([c for c in d.changes if c.ensemble], chain, direct, _served(plans["ensemble"])) == HandOverOrder()
    # An ensemble whose new steps name a block the server does not run yet is bridged instead.
    order = hand_over_order(ensembles, direct, chain, [s for s in _served(plans["direct"]) if s.name != "mid_b"])
    assert order == HandOverOrder(bridged=tuple(ensembles))
    # An undo runs both as plain chains while their blocks go back, whichever way their hand-overs changed.
    assert hand_overs_changed(ensembles, direct, chain) == hand_overs_changed(ensembles, chain, direct) == {"task_a", "task_b"}
    assert hand_overs_changed(ensembles, direct, direct) == frozenset()
    unreadable = {m: dataclasses.replace(r, unreadable="does not parse") for m, r in chain.items()}
    assert hand_overs_changed(ensembles, unreadable, direct) == frozenset()  # its hand-overs are unknown


def test_without_hand_overs_is_the_ensemble_the_generator_wires_without_them() -> None:
    plans = _hand_over_plans()
    direct, chain = plans["direct"].models, plans["ensemble"].models
    for task in ("task_a", "task_b"):
        bare = without_hand_overs(_cfg(direct, task))
        want = _cfg(chain, task)
        for cfg in (bare, want):
            del cfg.parameters[DIGEST_PARAMETER]
        assert to_pbtxt(bare) == to_pbtxt(want)
        assert handed_pairs(bare) == frozenset()
    bridged = parse_pbtxt(bridge(direct["task_a"]).files["config.pbtxt"].decode())
    assert bridged.parameters[DIGEST_PARAMETER].string_value == "bridge-" + _cfg(direct, "task_a").parameters[DIGEST_PARAMETER].string_value


def _mixed_plans() -> dict[str, RenderedRepository]:
    """:func:`_mixed_plan_objects`, rendered."""
    return {k: rendered.render(p) for k, p in _mixed_plan_objects().items()}


def _mixed_plan_objects() -> dict[str, Plan]:
    """A 5-block task ``long`` whose pair moves from b1 -> b2 to b2 -> b3 as another task, ``fork``,
    leaves the path after b1 instead of after b2 (it shares the blocks before)."""
    from blockflow.plan import parse_plan

    raw = {"version": 1, "name": "mixed", "transport": "tensormq", "hand_over": "direct", "references": [],
           "models": {"m": {"arch": "resnet18", "cut_points": ["layer1", "layer2", "layer3", "layer4"],
                            "input_shape": [3, 32, 32], "num_classes": 10}},
           "blocks": {**{f"b{i}": {"model": "m", "stages": i} for i in range(5)},
                      "f": {"model": "m", "stages": [3, 4]}, "g": {"model": "m", "stages": [2, 4]}},
           "tasks": {"long": {"path": [f"b{i}" for i in range(5)]}}}
    out = {}
    for name, fork in (("old", ["b0", "b1", "b2", "f"]), ("new", ["b0", "b1", "g"])):
        raw["tasks"]["fork"] = {"path": fork}
        out[name] = parse_plan(raw, source=name, base_dir=ROOT)
    return out


def test_an_ensemble_that_trades_hand_overs_runs_as_a_plain_chain_while_its_blocks_reload(tmp_path: Path) -> None:
    """Neither order is safe when a task's ensemble loses one hand-over and gains another: its old
    steps fail on the new blocks and its new steps on the old ones. A plain chain runs on both."""
    plans = _mixed_plans()
    old, new = plans["old"].models, plans["new"].models
    assert handed_pairs(_cfg(old, "long")) == {("b1", "b2")} and handed_pairs(_cfg(new, "long")) == {("b2", "b3")}
    served = _served(plans["old"])
    d = compute_diff(plans["new"], served)
    ensembles = [c for c in d.changes if c.ensemble and c.action != "remove"]
    order = hand_over_order(ensembles, old, new, served)
    # long trades pairs; fork loses its pair and names a new block, g: both are bridged.
    assert order == HandOverOrder(bridged=(Change("fork", True, "change"), Change("long", True, "change")))
    repo = tmp_path / "repo"
    generator.write(plans["old"].files, repo)
    rec = _Recorder(repo)
    seen: dict[str, str] = {}

    def recording(changes: list[Change], report: Report, how: str = "") -> None:
        _Recorder._load_all(rec, changes, report)
        if len(rec.waves) == 2:  # while the blocks load, the ensembles' files hold their bridges
            seen.update({m: (repo / m / "config.pbtxt").read_text() for m in ("long", "fork")})

    rec._load_all = recording  # type: ignore[method-assign]
    blocks = [c for c in d.changes if not c.ensemble and c.action != "remove"]
    done: list[Change] = []
    rec._load_waves(blocks, ensembles, new, done, Report(d), order, {m: old.get(m) for m in ("long", "fork")})
    assert rec.waves == [["fork", "long"], sorted(c.model for c in blocks), ["fork", "long"]]
    assert {"b1", "b2", "b3", "b4", "g"} <= set(rec.waves[1])
    assert all(handed_pairs(parse_pbtxt(text)) == frozenset() and "bridge-" in text for text in seen.values())
    assert (repo / "long" / "config.pbtxt").read_bytes() == new["long"].files["config.pbtxt"]
    assert len(done) == len(set(done))  # each change is undone once


def _swap_plans(at: int = 2, hand_over: str = "ensemble") -> dict[str, Plan]:
    """A 5-block task whose block ``at`` is swapped for a twin, h: the next block's feeder changes."""
    from blockflow.plan import parse_plan

    raw = {"version": 1, "name": "swap", "transport": "tensormq", "references": [], "hand_over": hand_over,
           "models": {"m": {"arch": "resnet18", "cut_points": ["layer1", "layer2", "layer3", "layer4"],
                            "input_shape": [3, 32, 32], "num_classes": 10}},
           "blocks": {**{f"b{i}": {"model": "m", "stages": i} for i in range(5)}, "h": {"model": "m", "stages": at}},
           "tasks": {}, "tensormq": {"lease_s": 20}}
    out = {}
    for name, swapped in (("old", f"b{at}"), ("new", "h")):
        raw["tasks"]["long"] = {"path": [swapped if i == at else f"b{i}" for i in range(5)]}
        out[name] = parse_plan(raw, source=name, base_dir=ROOT)
    return out


def test_a_receiver_whose_keys_come_from_another_block_also_takes_the_old_ones() -> None:
    """Direct hand-overs b1 -> b2 -> b3 are keyed by the ticket b1 takes: b0 swapped for h changes
    b1's feeder and the receivers' keys. Their pairs stay, so the blocks load first, and the old
    ensemble gives the new b2 and b3 b0's tickets as keys."""
    plans = _swap_plans(at=0, hand_over="direct")
    old, new = (rendered.render(plans[k]) for k in ("old", "new"))
    d = compute_diff(new, _served(old))
    assert hand_over_order([c for c in d.changes if c.ensemble], old.models, new.models,
                           _served(old)) == HandOverOrder()
    w = widening(d.changes, old.models, new.models)
    assert w.new == {"b1": AlsoAccepts(models=("b0",)), "b2": AlsoAccepts(keys=("b0",)), "b3": AlsoAccepts(keys=("b0",))}
    assert w.old == {"b1": AlsoAccepts(models=("h",)), "b2": AlsoAccepts(keys=("h",)), "b3": AlsoAccepts(keys=("h",))}


class _Applying(_Recorder):
    """A whole :meth:`Applier.apply` against a server that serves ``served`` (its loads recorded), the
    load of wave ``fail_at`` failing."""

    def __init__(self, repository: Path, served: list[Served], fail_at: int | None = None) -> None:
        super().__init__(repository)
        self.control = SimpleNamespace(timeout=900.0)  # type: ignore[assignment]
        self.current = None
        self._served, self.fail_at = served, fail_at
        self.files_seen: list[dict[str, bytes]] = []  # b3's also_accepts file at each wave
        self.reloaded: list[str] = []
        self.loaded: list[str] = []  # what the waves loaded
        self.unloaded: list[str] = []

    def served(self) -> list[Served]:
        names = {s.name for s in self._served}
        return self._served + [Served(m, False, "new") for m in self.loaded if m not in names]

    def _load_all(self, changes: list[Change], report: Report, how: str = "") -> None:
        super()._load_all(changes, report, how)
        f = self.repository / "b3" / also_accepts.FILE
        self.files_seen.append({"b3": f.read_bytes()} if f.is_file() else {})
        if len(self.waves) == self.fail_at:
            self.loaded.append(changes[0].model)  # one load of the wave succeeded, another failed
            raise ApplyError("the test's load failed")
        self.loaded += [c.model for c in changes]

    def _load(self, model: str) -> None:
        self.reloaded.append(model)

    def _unload(self, model: str) -> None:
        self.unloaded.append(model)

    def _states(self) -> dict[str, set[str]]:
        return {s.name: {"READY"} for s in self.served() if s.name not in self.unloaded}


def _also(files: dict[str, bytes]) -> also_accepts.AlsoAccepts:
    return also_accepts.AlsoAccepts.model_validate_json(files["b3"])


def test_a_block_given_other_feeders_also_accepts_the_old_ones_until_the_change_is_over(tmp_path: Path) -> None:
    """b3 reloads to take h's tickets while the old ensemble still sends it b2's: it accepts both
    until the new ensemble has loaded, then for the plan's lease. Undone, the restored b3 accepts h's."""
    plans = _swap_plans()
    old, new = (rendered.render(plans[k]) for k in ("old", "new"))
    d = compute_diff(new, _served(old))
    assert widening(d.changes, old.models, new.models) == Widening(
        new={"b3": AlsoAccepts(models=("b2",))}, old={"b3": AlsoAccepts(models=("h",))}, lease_s={"b3": 20.0})
    for fail_at, feeders in ((None, ("b2",)), (2, ("h",))):
        repo = tmp_path / f"repo{fail_at}"
        generator.write(old.files, repo)
        rec = _Applying(repo, _served(old), fail_at)
        t0 = time.time()
        if fail_at is None:
            rec.apply(plans["new"])
        else:
            with pytest.raises(ApplyError, match="rolled back"):
                rec.apply(plans["new"])
        assert rec.waves == [["b3", "h"], ["long"]]
        during = _also(rec.files_seen[0])  # while the blocks load: until the change is over, at the latest
        assert during.models == ("b2",) and during.until >= t0 + 3600
        after = also_accepts.AlsoAccepts.model_validate_json((repo / "b3" / also_accepts.FILE).read_bytes())
        assert after.models == feeders and t0 + 20 <= after.until <= time.time() + 20
        if fail_at is not None:
            assert rec.reloaded == ["b3", "long"]  # the previous block, then the previous ensemble
        # Not the plan's: the repository is in step with the plan it serves, file or not.
        assert generator.diff((old if fail_at else new).files, repo) == []


def test_a_failed_change_with_bridges_puts_every_old_file_back_and_reloads_blocks_before_ensembles(tmp_path: Path) -> None:
    """The trading change fails while its blocks load: the bridged ensembles run as plain chains of
    their old steps while the previous blocks reload, then their old files (with their hand-overs) go
    back and they reload, and the new block that had loaded is unloaded."""
    plans = _mixed_plan_objects()
    old = rendered.render(plans["old"])
    repo = tmp_path / "repo"
    generator.write(old.files, repo)
    served = _served(old)
    rec = _Applying(repo, served, fail_at=2)
    with pytest.raises(ApplyError, match="rolled back"):
        rec.apply(plans["new"])
    assert rec.waves[0] == ["fork", "long"] and len(rec.waves) == 2
    assert rec.loaded[-1] == "g"  # the wave's first load (added blocks come first) succeeded
    assert rec.reloaded == ["fork", "long"] + [m for m in rec.waves[1] if m != "g"] + ["fork", "long"]
    assert rec.unloaded == ["g"]
    assert generator.diff(old.files, repo) == []  # every old file back, no bridge, no new block


def _recut_plans(path: str = "b0 b1 b2 b3 b4", references: tuple[str, ...] = (), **new_blocks: Any) -> dict[str, Plan]:
    """``long`` = b0 -> b1 -> b2 -> b3 -> b4 over five stages, and ``other`` = b0 -> b1 -> o; ``new``
    changes the blocks given, under their names, and ``long``'s path to ``path``."""
    from blockflow.plan import parse_plan

    raw: dict[str, Any] = {
        "version": 1, "name": "recut", "transport": "tensormq", "references": list(references),
        "models": {"m": {"arch": "resnet18", "cut_points": ["layer1", "layer2", "layer3", "layer4"],
                         "input_shape": [3, 32, 32], "num_classes": 10}},
        "blocks": {**{f"b{i}": {"model": "m", "stages": i} for i in range(5)}, "o": {"model": "m", "stages": [2, 4]}},
        "tasks": {"long": {"path": [f"b{i}" for i in range(5)]}, "other": {"path": ["b0", "b1", "o"]}}}
    old = parse_plan(raw, source="old", base_dir=ROOT)
    raw["blocks"].update(new_blocks)
    raw["tasks"]["long"]["path"] = path.split()
    return {"old": old, "new": parse_plan(raw, source="new", base_dir=ROOT)}


def _stand_ins_of(plans: dict[str, Plan]) -> tuple[str, ...]:
    old, new = (rendered.render(plans[k]).models for k in ("old", "new"))
    served = _served(rendered.render(plans["old"]))
    d = compute_diff(rendered.render(plans["new"]), served)
    return stand_ins(d.changes, {s.name: old[s.name] for s in served if s.ensemble}, {c.model: old.get(c.model) for c in d.changes}, new)


def test_blocks_that_would_mix_two_plans_in_one_request_load_under_other_names_first() -> None:
    # Re-cut in place: b2 takes stages 2-3 and b3 stage 4, b4 leaves long's path. A request of the old
    # ensemble could meet the new b2 and the old b3 (refused: another shape), or the new b3 and b4.
    assert _stand_ins_of(_recut_plans("b0 b1 b2 b3", b2={"model": "m", "stages": [2, 3]}, b3={"model": "m", "stages": 4})) == ("b2", "b3")
    # New weights for two blocks of one path: a request could take one plan's b1 and the other's b3.
    seeds = {"b1": {"model": "m", "stages": 1, "weights": {"seed": 7}}, "b3": {"model": "m", "stages": 3, "weights": {"seed": 7}}}
    assert _stand_ins_of(_recut_plans(**seeds)) == ("b1", "b3")
    # One block with new weights on paths that keep their steps: every request is one plan's or the other's.
    assert _stand_ins_of(_recut_plans(b3={"model": "m", "stages": 3, "weights": {"seed": 7}})) == ()
    # How blocks are served does not change what they compute.
    assert _stand_ins_of(_recut_plans(b1={"model": "m", "stages": 1, "instances": 2, "max_batch_size": 4},
                                      b2={"model": "m", "stages": 2, "cuda_graphs": False})) == ()
    # One block that computes something else, in an ensemble whose steps change: b4 leaves long's path.
    assert _stand_ins_of(_recut_plans("b0 b1 b2 b3", b3={"model": "m", "stages": [3, 4]})) == ("b3",)


class _Server(_Recorder):
    """A whole :meth:`Applier.apply` against a pretend server whose models are what was loaded from
    the repository (digests read from the files on disk); the ensembles' steps at each wave recorded."""

    def __init__(self, repository: Path, fail_at: int | None = None) -> None:
        super().__init__(repository)
        self.control = SimpleNamespace(timeout=900.0)  # type: ignore[assignment]
        self.current = None
        self.fail_at = fail_at
        self.models: dict[str, Served] = {}
        self.seen: list[dict[str, tuple[str, ...]]] = []  # the served ensembles' steps after each wave

    def _served_model(self, name: str) -> Served:
        cfg = parse_pbtxt((self.repository / name / "config.pbtxt").read_text())
        return Served(name, cfg.platform == "ensemble", cfg.parameters[DIGEST_PARAMETER].string_value)

    def served(self) -> list[Served]:
        return list(self.models.values())

    def _load_all(self, changes: list[Change], report: Report, how: str = "") -> None:
        super()._load_all(changes, report, how)
        if len(self.waves) == self.fail_at:
            raise ApplyError("the test's load failed")
        for c in changes:
            self._load(c.model)
            report.steps.append(f"loaded {c.model}")
        self.seen.append({s.name: tuple(st.model_name for st in parse_pbtxt(
            (self.repository / s.name / "config.pbtxt").read_text()).ensemble_scheduling.step)
            for s in self.models.values() if s.ensemble})

    def _load(self, model: str) -> None:
        self.models[model] = self._served_model(model)

    def _unload(self, model: str) -> None:
        del self.models[model]

    def _states(self) -> dict[str, set[str]]:
        return {m: {"READY"} for m in self.models}


def test_a_recut_under_the_same_names_runs_through_stand_ins_and_ends_as_planned(tmp_path: Path) -> None:
    """Every ensemble a request can start on names blocks of one plan only, at every wave; the
    server ends on the plan with no stand-in left. A failure in the second apply leaves the
    first one's (the new plan under other names) serving, and says so."""
    plans = _recut_plans("b0 b1 b2 b3", references=("graph",), b2={"model": "m", "stages": [2, 3]}, b3={"model": "m", "stages": 4})
    old = rendered.render(plans["old"])
    repo = tmp_path / "repo"
    generator.write(old.files, repo)
    srv = _Server(repo)
    srv.models = {s.name: s for s in _served(old)}
    dry = srv.apply(plans["new"], dry_run=True)  # says what it would do first, and does nothing
    assert dry.stand_ins == ("b2", "b3") and "b2 as b2__next, b3 as b3__next" in stand_in_note(dry.stand_ins) and srv.waves == []
    report = srv.apply(plans["new"])
    # long's reference names its parts' blocks: it loads once, as planned, with the stand-ins.
    assert srv.waves == [["b2__next", "b3__next", "long__ref_graph"], ["long"], ["b2", "b3"], ["long"]]
    old_long, stone, new_long = ("b0", "b1", "b2", "b3", "b4"), ("b0", "b1", "b2__next", "b3__next"), ("b0", "b1", "b2", "b3")
    assert [w["long"] for w in srv.seen] == [old_long, stone, stone, new_long]
    assert report.steps[-2:] == ["unloaded b2__next", "unloaded b3__next"] and "unloaded b4" in report.steps
    assert report.total == len(report.steps)
    assert {s.name for s in srv.served()} == set(rendered.render(plans["new"]).models)
    assert generator.diff(rendered.render(plans["new"]).files, repo) == []

    repo2 = tmp_path / "repo2"
    generator.write(old.files, repo2)
    failing = _Server(repo2, fail_at=3)
    failing.models = {s.name: s for s in _served(old)}
    with pytest.raises(ApplyError, match=r"serves the new plan, with b2 as b2__next, b3 as b3__next \(apply the plan again"):
        failing.apply(plans["new"])
    assert failing.seen[-1]["long"] == stone and {"b2__next", "b3__next"} <= {s.name for s in failing.served()}
    # Applying the plan again finishes it: a rename back, no block reloaded in place, no stand-in.
    failing.fail_at, failing.waves, failing.seen = None, [], []
    again = failing.apply(plans["new"])
    assert again.stand_ins == () and failing.waves == [["b2", "b3"], ["long"]]
    assert [w["long"] for w in failing.seen] == [stone, new_long]
    assert {"unloaded b2__next", "unloaded b3__next"} <= set(again.steps)
    assert generator.diff(rendered.render(plans["new"]).files, repo2) == []


def _stand_ins_between(old_plan: Plan, new_plan: Plan) -> tuple[str, ...]:
    return _stand_ins_of({"old": old_plan, "new": new_plan})


def test_a_changed_head_pack_is_renamed_with_the_model_it_is_named_after() -> None:
    """``pack: heads``: the pack is named after the model before it, so a re-weighted pack and trunk
    rename the unchanged model between them too; each of the two applies then needs no stand-in."""
    from blockflow.control.order import with_stand_ins
    from blockflow.plan import parse_plan

    raw: dict[str, Any] = {
        "version": 1, "name": "packs", "transport": "tensormq", "references": [], "pack": "heads",
        "models": {"m": {"arch": "resnet18", "cut_points": ["layer1", "layer2", "layer3", "layer4"],
                         "input_shape": [3, 32, 32], "num_classes": 10}},
        "blocks": {"a": {"model": "m", "stages": [0, 1]}, "b": {"model": "m", "stages": 2},
                   "h1": {"model": "m", "stages": [3, 4]}, "h2": {"model": "m", "stages": [3, 4], "weights": {"seed": 2}}},
        "tasks": {"t1": {"path": ["a", "b", "h1"]}, "t2": {"path": ["a", "b", "h2"]}}}
    old = parse_plan(raw, source="old", base_dir=ROOT)
    raw["blocks"]["a"]["weights"] = {"seed": 3}
    raw["blocks"]["h1"]["weights"] = {"seed": 4}
    new = parse_plan(raw, source="new", base_dir=ROOT)
    assert "b__heads" in rendered.render(new).models
    first = _stand_ins_between(old, new)
    assert first == ("a", "b", "h1", "h2")
    stone = with_stand_ins(new, first)
    assert "b__next__heads" in rendered.render(stone).models
    assert _stand_ins_between(old, stone) == () and _stand_ins_between(stone, new) == ()


def test_the_plan_history_keeps_the_last_ten(tmp_path: Path) -> None:
    """The control service's history on disk: each applied plan numbered, the oldest dropped past
    ``keep`` (10), so a rollback can go at most nine plans back."""
    from blockflow.control.service import Controller

    c = Controller(Applier.__new__(Applier), tmp_path / "state", base_dir=tmp_path)
    for i in range(12):
        c._record(f"# plan {i}\n", A if i % 2 else B)
    history = c.history()
    assert [e.number for e in history] == list(range(3, 13)) and [e.name for e in history[-2:]] == ["live-b", "live-a"]
    with pytest.raises(ApplyError, match="at most 9 step"):
        c.rollback(10)


def test_a_restarted_serve_resumes_the_plan_applied_live_unless_the_plan_file_changed(tmp_path: Path) -> None:
    """The history in --state-dir: a serve started again with the same plan file serves the newest plan applied live
    (a pod restarted on its persistent volume); one started with another plan file serves that file."""
    from blockflow.control.service import Controller, entry_text, resumable

    state = tmp_path / "plans"
    a_text, b_text = (ROOT / "tests" / "plans" / "live_a.yaml").read_text(), (ROOT / "tests" / "plans" / "live_b.yaml").read_text()
    a, b = load_plan(ROOT / "tests" / "plans" / "live_a.yaml"), load_plan(ROOT / "tests" / "plans" / "live_b.yaml")
    controller = Controller(SimpleNamespace(), state, base_dir=tmp_path)  # type: ignore[arg-type]
    assert resumable(state, a_text) is None  # nothing kept yet
    controller.adopt(a_text, a)
    assert resumable(state, a_text) is None  # the history's newest is the file's plan
    controller._record(b_text, b)  # what a successful POST /plan of plan B records
    resumed = resumable(state, a_text)
    assert resumed is not None and resumed.name == "live-b" and entry_text(resumed) == b_text
    assert resumable(state, "version: 1\n# the operator's new plan file\n") is None
    again = Controller(SimpleNamespace(), state, base_dir=tmp_path)  # type: ignore[arg-type]
    again.adopt(b_text, b, started_from=a_text)  # serve resumed: no second entry, still started from A
    assert [e.name for e in again.history()] == ["live-a", "live-b"] and resumable(state, a_text) == resumed


def test_an_apply_that_changes_a_blocks_part_in_a_chain_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A link takes no requests and a chain's head hands over what no old ensemble asks for, so a
    running server cannot switch a task into or out of a chain."""
    import yaml

    from blockflow.control.order import chain_parts_changed
    from blockflow.plan import parse_plan

    raw = yaml.safe_load((ROOT / "tests" / "plans" / "hand_over.yaml").read_text())
    plans = {mode: parse_plan({**raw, "hand_over": mode, "compare": [], "references": []}, source=mode, base_dir=ROOT)
             for mode in ("ensemble", "chain")}
    old, new = (rendered.render(plans[k]) for k in ("ensemble", "chain"))
    d = compute_diff(new, _served(old))
    blocks = [c for c in d.changes if not c.ensemble]
    assert chain_parts_changed(blocks, old.models, new.models) == ("mid_a", "mid_b", "stem")  # a join takes either
    assert chain_parts_changed(blocks, new.models, new.models) == ()
    repo = tmp_path / "repo"
    generator.write(old.files, repo)
    rec = _Applying(repo, _served(old))
    for dry_run in (True, False):  # a dry run says so too
        with pytest.raises(ApplyError, match="part in a chain"):
            rec.apply(plans["chain"], dry_run=dry_run)
    assert rec.waves == [] and generator.diff(old.files, repo) == []  # nothing loaded, nothing written
