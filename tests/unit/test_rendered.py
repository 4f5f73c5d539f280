"""A rendered repository as typed models: configs parsed once, the generator's bytes kept, and a bad
config refused with the model's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockflow.control.apply import expected_instances
from blockflow.control.diff import as_served, compute_diff
from blockflow.control.order import bridge, hand_over_order, stand_ins, widening
from blockflow.core.errors import GenerateError
from blockflow.core.spec import ModelSpec
from blockflow.ensemble_gen import configs, generator, rendered
from blockflow.ensemble_gen.rendered import RenderedModel, RenderedRepository
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
A = load_plan(ROOT / "tests" / "plans" / "live_a.yaml")
B = load_plan(ROOT / "tests" / "plans" / "live_b.yaml")


def test_a_rendered_repository_keeps_the_generators_bytes_and_types_each_model() -> None:
    files = generator.render(A)
    repo = RenderedRepository.parse(files)
    assert repo.files == files and list(repo.files) == list(files)
    assert set(repo.models) == set(generator.model_names(files))
    trunk, keep = repo.models["trunk"], repo.models["keep"]
    assert isinstance(trunk.spec, ModelSpec) and trunk.spec.parts[0].block == "trunk" and not trunk.ensemble
    assert keep.ensemble and keep.spec is None and keep.steps[0] == "trunk"
    assert trunk.digest == trunk.config.parameters[configs.DIGEST_PARAMETER].string_value != ""


def test_the_control_layer_parses_no_config_again(monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = rendered.render(A), rendered.render(B)

    def refused(text: str) -> None:
        raise AssertionError("a config parsed again")

    monkeypatch.setattr(configs, "parse_pbtxt", refused)
    monkeypatch.setattr(rendered, "parse_pbtxt", refused)
    d = compute_diff(new, as_served(old))
    changed = {c.model: old.models.get(c.model) for c in d.changes}
    hand_over_order([c for c in d.changes if c.ensemble], changed, new.models, as_served(old))
    widening(d.changes, changed, new.models)
    stand_ins(d.changes, {m.name: m for m in old.models.values() if m.ensemble}, changed, new.models)
    assert configs.config_changes(old.models["head_keep"].config, new.models["head_keep"].config)
    assert expected_instances(new, gpus=0)["trunk"] == 1
    assert bridge(old.models["swap"]).digest == "bridge-" + old.models["swap"].digest


def test_a_bad_config_is_refused_with_the_models_name(tmp_path: Path) -> None:
    files = generator.by_model(generator.render(A))["trunk"]
    with pytest.raises(GenerateError, match=r"model trunk in the rendered repository: its config.pbtxt does not parse"):
        RenderedModel.parse("trunk", {**files, "config.pbtxt": b"name: 'trunk'\nnot_a_field: 1\n"})
    with pytest.raises(GenerateError, match=r"model trunk in the rendered repository has no config.pbtxt"):
        RenderedModel.parse("trunk", {"1/model.py": files["1/model.py"]})
    spec_broken = files["config.pbtxt"].replace(b'"kind\\":\\"block\\"', b'"kind\\":\\"nonsense\\"')
    assert spec_broken != files["config.pbtxt"]
    with pytest.raises(GenerateError, match=r"model trunk in the rendered repository: its 'blockflow.spec' parameter"):
        RenderedModel.parse("trunk", {**files, "config.pbtxt": spec_broken})
    # On disk: the repository is named, and a model without a directory is None.
    repo = tmp_path / "repo"
    generator.write(generator.render(A), repo)
    assert rendered.read_model(repo, "absent") is None
    on_disk = rendered.read_model(repo, "trunk")
    assert on_disk is not None and on_disk.files == files
    (repo / "trunk" / "config.pbtxt").write_text("{{{")
    with pytest.raises(GenerateError, match=rf"model trunk in {repo}: its config.pbtxt does not parse"):
        rendered.read_model(repo, "trunk")
    # Read for a plan change, the broken model comes back with its files and why, so the change can replace it.
    lenient = rendered.read_model(repo, "trunk", lenient=True)
    assert lenient is not None and lenient.spec is None and lenient.files["config.pbtxt"] == b"{{{"
    assert "does not parse" in lenient.unreadable and not lenient.ensemble and lenient.digest == ""
    assert on_disk.unreadable == ""
