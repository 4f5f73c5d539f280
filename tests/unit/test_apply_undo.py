"""An undo's new models against a pretend Triton index: their directories stay until their loads have
ended and they are unloaded (tests/integration/test_apply_undo.py runs it on a real server)."""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc.model_config_pb2 import ModelConfig

from blockflow.control.apply import Applier
from blockflow.control.diff import Change
from blockflow.control.order import bridge
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.rendered import RenderedModel
from blockflow.triton.api import ModelState


class _Triton:
    """Each model's states at successive index reads (the last one repeats); as Triton's, the index lists
    only models with a directory, and an unload returns at once, the model UNLOADING for a read."""

    def __init__(self, repo: Path, script: dict[str, list[str]]) -> None:
        self.repo, self.script = repo, {m: list(s) for m, s in script.items()}
        self.timeout = 0.1
        self.unloaded: list[str] = []
        self.events: list[str] = []  # loads and unloads, in order
        self.on_disk: list[tuple[str, dict[str, str]]] = []  # each load: the model, and every config file then

    def index(self) -> list[ModelState]:
        out = []
        for m, states in sorted(self.script.items()):
            state = states.pop(0) if len(states) > 1 else states[0]
            if (self.repo / m).is_dir():
                out.append(ModelState(m, state))
            else:  # tritonserver 2.51 crashed when a starting model's directory went away
                assert state not in ("LOADING", "UNLOADING"), f"{m}'s directory went while it was {state}"
        return out

    def unload(self, model: str) -> None:
        assert self.script[model][0] == "READY", f"{model} unloaded while {self.script[model][0]}"
        assert not any(self.script[e][0] in ("READY", "UNLOADING") for e in self.unloaded), "an ensemble first"
        self.unloaded.append(model)
        self.events.append(f"unload {model}")
        self.script[model] = ["UNLOADING", "UNAVAILABLE"]

    def load(self, model: str) -> None:
        self.events.append(f"load {model}")
        self.script[model] = ["READY"]
        # What each model's files say as it loads (Triton also reloads a loaded block's ensembles from theirs).
        self.on_disk.append((model, {m: (self.repo / m / "config.pbtxt").read_text().strip()
                                     for m in self.script if (self.repo / m / "config.pbtxt").is_file()}))


def _undo(tmp_path: Path, script: dict[str, list[str]], ensembles: set[str], wait_s: float,
          changed: frozenset[str] = frozenset()) -> tuple[list[str], _Triton]:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / generator.MARKER).write_text("{}")
    for m in script:
        generator.write_model(repo, m, {"config.pbtxt": f'name: "{m}"\n'.encode()})
    applier = Applier("127.0.0.1:1", repo)
    triton = _Triton(repo, script)
    applier.control = triton  # type: ignore[assignment]
    applier.undo_wait_s = wait_s
    done = [Change(m, m in ensembles, "change" if m in changed else "add") for m in script]
    backup = {m: RenderedModel(m, {"config.pbtxt": f'name: "{m}" # before\n'.encode()}, ModelConfig(), None)
              if m in changed else None for m in script}
    return applier._undo(done, backup), triton


def test_a_new_model_still_loading_is_unloaded_once_ready_then_deleted(tmp_path: Path) -> None:
    notes, triton = _undo(tmp_path, {"slow": ["LOADING"] * 3 + ["READY"], "failed": ["UNAVAILABLE"], "never": [""],
                                     "task": ["READY"]}, {"task"}, wait_s=30)
    assert triton.unloaded == ["task", "slow"]
    assert notes == ["unloaded new task", "unloaded new slow"]
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == [generator.MARKER]


def test_a_load_that_does_not_end_in_time_is_left_in_place_and_said(tmp_path: Path) -> None:
    notes, triton = _undo(tmp_path, {"stuck": ["LOADING"], "done": ["READY"]}, set(), wait_s=0.5)
    assert triton.unloaded == ["done"]
    assert notes[0].startswith("new stuck was still loading") and notes[1:] == ["unloaded new done"]
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == sorted([generator.MARKER, "stuck"])


def test_new_ensembles_go_before_a_changed_block_is_reloaded_and_new_blocks_after(tmp_path: Path) -> None:
    notes, triton = _undo(tmp_path, {"shared": ["READY"], "new_task": ["READY"], "new_head": ["READY"]},
                          {"new_task"}, wait_s=5, changed=frozenset({"shared"}))
    # new_task runs shared: while it is loaded, shared keeps the interface it was loaded with.
    assert triton.events == ["unload new_task", "load shared", "unload new_head"]
    assert notes == ["unloaded new new_task", "reloaded the previous shared", "unloaded new new_head"]
    assert (tmp_path / "repo" / "shared" / "config.pbtxt").read_text().endswith("# before\n")
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == sorted([generator.MARKER, "shared"])


def test_an_ensemble_whose_hand_overs_changed_runs_as_a_plain_chain_while_its_blocks_go_back(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / generator.MARKER).write_text("{}")
    script = {"b1": ["READY"], "b2": ["READY"], "task": ["READY"], "other": ["READY"]}
    for m in script:
        generator.write_model(repo, m, {"config.pbtxt": f'name: "{m}" # planned\n'.encode()})
    applier = Applier("127.0.0.1:1", repo)
    triton = _Triton(repo, script)
    applier.control = triton  # type: ignore[assignment]
    old = {m: RenderedModel(m, {"config.pbtxt": f'name: "{m}" # before\n'.encode()}, ModelConfig(), None) for m in ("b1", "b2")}
    old |= {m: RenderedModel.parse(m, {"config.pbtxt": f'name: "{m}" platform: "ensemble" # before\n'.encode()}) for m in ("task", "other")}
    done = [Change("b1", False, "change"), Change("b2", False, "change"),
            Change("task", True, "change"), Change("other", True, "change")]
    notes = applier._undo(done, old, frozenset({"task"}))
    plain = bridge(old["task"]).files["config.pbtxt"].decode().strip()
    assert "before" not in plain
    assert triton.events == ["load task", "load b1", "load b2", "load task", "load other"]
    # task's files hold the plain chain while b1 and b2 go back (Triton reloads it from them meanwhile),
    # and only then its own; other (hand-overs unchanged) has its previous files from the start.
    for model, files in triton.on_disk[:3]:
        assert files["task"] == plain, model
    for model, files in triton.on_disk[1:3]:
        assert files["other"] == 'name: "other" platform: "ensemble" # before', model
    assert triton.on_disk[1][1]["b1"] == 'name: "b1" # before'
    assert triton.on_disk[3][1]["task"] == 'name: "task" platform: "ensemble" # before'
    assert notes == ["loaded task as its previous steps without hand-overs"] + [
        f"reloaded the previous {m}" for m in ("b1", "b2", "task", "other")]


def test_without_a_block_going_back_no_plain_chain_is_loaded(tmp_path: Path) -> None:
    notes, triton = _undo(tmp_path, {"task": ["READY"]}, {"task"}, wait_s=5, changed=frozenset({"task"}))
    assert triton.events == ["load task"] and notes == ["reloaded the previous task"]
