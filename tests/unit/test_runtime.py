"""The block runtime on the CPU: splitting is exact, weights are deterministic and loadable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from blockflow.backend.graphs import batch_buckets, bucket_for
from blockflow.backend.runtime import BlockRunner
from blockflow.core import arch
from blockflow.core.errors import BlockError, PlanError, RequestError
from blockflow.core.spec import ModelSpec, Part, WeightsSource
from blockflow.core.trained_weights import trained_weights
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.plan import load_plan, parse_plan

from ..conftest import tensor_error

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.mark.parametrize(("name", "cuts", "shape"), [
    ("resnet18", ["maxpool", "layer3"], (3, 64, 64)),
    ("resnet50", ["layer1", "layer2", "layer3"], (3, 96, 96)),
    ("resnet34", ["relu", "layer1", "layer4", "avgpool"], (3, 64, 64)),
])
def test_stages_compose_to_the_torchvision_model(name: str, cuts: list[str], shape: tuple[int, ...]) -> None:
    net = arch.build_network(name, 1000, seed=3)
    x = torch.randn(2, *shape)
    with torch.inference_mode():
        full = net(x)
        y = x
        for i in range(len(cuts) + 1):
            y = arch.slice_stages(net, name, cuts, i, i)(y)
    assert tensor_error(y, full) <= 1e-6
    assert arch.stage_output_shapes(name, cuts, shape, 1000)[-1] == ((1000,),)


def test_seeded_weights_are_deterministic_and_seed_dependent() -> None:
    a = arch.build_network("resnet18", 10, seed=5).state_dict()
    b = arch.build_network("resnet18", 10, seed=5).state_dict()
    c = arch.build_network("resnet18", 10, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv1.weight"], c["conv1.weight"])
    before = torch.get_rng_state()
    arch.build_network("resnet18", 10, seed=5)
    assert torch.equal(before, torch.get_rng_state())  # the caller's RNG is untouched


def test_task_path_equals_reference_at_several_batches() -> None:
    plan = load_plan(ROOT / "tests" / "plans" / "r18_three_cuts.yaml")
    task = plan.tasks["t18_two"]
    runners = [BlockRunner(block_spec(plan, plan.blocks[b], "triton-gpu"), CPU) for b in task.path]
    ref = BlockRunner(reference_spec(plan, task, graph=False)[0], CPU)
    for batch in (1, 3, 8):
        x = torch.randn(batch, 3, 64, 64)
        y = x
        for r in runners:
            y = r.run(y)
        assert y.shape == (batch, 10)
        assert tensor_error(y, ref.run(x)) <= 1e-5


def test_bad_input_is_a_request_error() -> None:
    plan = load_plan(ROOT / "tests" / "plans" / "r18_three_cuts.yaml")
    runner = BlockRunner(block_spec(plan, plan.blocks["r18_a"], "triton-gpu"), CPU)
    with pytest.raises(RequestError, match="does not match"):
        runner.run(torch.randn(1, 3, 32, 32))


def test_buckets() -> None:
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert bucket_for(3, batch_buckets(8)) == 4
    with pytest.raises(RequestError):
        bucket_for(9, batch_buckets(8))
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    # With quarters, quarter steps above 16 too: a batch runs at most a quarter of padding.
    assert batch_buckets(32, quarters=True) == [1, 2, 4, 8, 16, 20, 24, 28, 32]
    assert batch_buckets(64, quarters=True)[4:] == [16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert batch_buckets(30, quarters=True) == [1, 2, 4, 8, 16, 20, 24, 28, 30]
    assert batch_buckets(17, quarters=True) == [1, 2, 4, 8, 16, 17]
    assert bucket_for(17, batch_buckets(32, quarters=True)) == 20


def _spec_with_file(path: Path, first: int = 2, last: int = 2) -> ModelSpec:
    return ModelSpec(kind="block", name="b", arch="resnet18", cut_points=("maxpool", "layer3"), num_classes=10,
                     input_shape=(3, 64, 64), parts=(Part(block="b", first=first, last=last, weights=WeightsSource(file=str(path))),),
                     precision="fp32", cuda_graphs=False, max_batch_size=4, transport="triton-gpu",
                     in_shape=(256, 4, 4), out_shape=(10,))


def test_weights_file_for_whole_model_or_just_the_block(tmp_path: Path) -> None:
    net = arch.build_network("resnet18", 10, seed=42)
    whole = tmp_path / "whole.pt"
    torch.save(net.state_dict(), whole)
    block_only = tmp_path / "block.pt"
    torch.save({k: v for k, v in net.state_dict().items() if k.startswith(("layer4.", "fc."))}, block_only)
    x = torch.randn(2, 256, 4, 4)
    with torch.inference_mode():
        expected = arch.slice_stages(net, "resnet18", ["maxpool", "layer3"], 2, 2)(x)
    from safetensors.torch import save_file

    safe = tmp_path / "whole.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, safe)
    for f in (whole, block_only, safe):
        assert tensor_error(BlockRunner(_spec_with_file(f), CPU).run(x), expected) <= 1e-6


def test_bad_weights_files_fail_clearly(tmp_path: Path) -> None:
    partial = tmp_path / "partial.pt"
    torch.save({"fc.weight": torch.zeros(10, 512)}, partial)
    with pytest.raises(BlockError, match="lacks .* tensor"):
        BlockRunner(_spec_with_file(partial), CPU)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(BlockError, match="cannot read weights file"):
        BlockRunner(_spec_with_file(garbage), CPU)
    bad_safe = tmp_path / "garbage.safetensors"
    bad_safe.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(BlockError, match="cannot read weights file .*garbage.safetensors"):
        BlockRunner(_spec_with_file(bad_safe), CPU)
    wrong = tmp_path / "wrong.pt"
    net = arch.build_network("resnet18", 1000, seed=0)  # 1000 classes: fc does not fit a 10-class block
    torch.save(net.state_dict(), wrong)
    with pytest.raises(BlockError, match="does not fit"):
        BlockRunner(_spec_with_file(wrong), CPU)


def test_plan_with_weights_file_round_trip(tmp_path: Path) -> None:
    net = arch.build_network("resnet18", 10, seed=1)
    torch.save(net.state_dict(), tmp_path / "r18.pt")
    plan = parse_plan({
        "version": 1,
        "models": {"m": {"arch": "resnet18", "cut_points": ["layer2"], "input_shape": [3, 64, 64], "num_classes": 10}},
        "blocks": {"a": {"model": "m", "stages": 0, "weights": {"file": "r18.pt"}},
                   "b": {"model": "m", "stages": 1, "weights": {"file": "r18.pt"}}},
        "tasks": {"t": {"path": ["a", "b"]}},
        "transport": "triton-gpu",
    }, base_dir=tmp_path)
    x = torch.randn(2, 3, 64, 64)
    y = x
    for b in ("a", "b"):
        y = BlockRunner(block_spec(plan, plan.blocks[b], "triton-gpu"), CPU).run(y)
    with torch.inference_mode():
        assert tensor_error(y, net(x)) <= 1e-5


TRAINED_PLAN = """
version: 1
models: {r18: {arch: resnet18, cut_points: [layer2], input_shape: [3, 64, 64]}}
defaults: {placement: cpu, max_batch_size: 2, cuda_graphs: false}
blocks:
  a: {model: r18, stages: 0, weights: {torchvision: DEFAULT}}
  b: {model: r18, stages: 1, weights: {torchvision: IMAGENET1K_V1}}
tasks: {t: {path: [a, b]}}
transport: tensormq
"""


def test_torchvisions_trained_weights_come_from_torch_hubs_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``weights: {torchvision: NAME}``: the file torchvision's weights API keeps in torch hub's cache, read without a
    network (here a seeded network's weights, put there under torchvision's file name)."""
    from blockflow.plan import parse_plan_text

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    trained = trained_weights("resnet18", "DEFAULT")
    assert trained.name == "IMAGENET1K_V1" and trained.cached.startswith(str(tmp_path / "torch" / "hub" / "checkpoints"))
    net = arch.build_network("resnet18", 1000, seed=7, input_shape=(3, 64, 64))
    Path(trained.cached).parent.mkdir(parents=True)
    torch.save(net.state_dict(), trained.cached)
    plan = parse_plan_text(TRAINED_PLAN, source="trained.yaml")
    assert {b.weights.torchvision for b in plan.blocks.values()} == {"IMAGENET1K_V1"}  # DEFAULT, as torchvision names it
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        expected = net(x)
        got = x
        for name in ("a", "b"):
            got = BlockRunner(block_spec(plan, plan.blocks[name], "triton-gpu"), CPU).run(got)
    assert tensor_error(got, expected) <= 1e-5


def test_trained_weights_that_cannot_be_had_fail_with_the_file_and_where_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib.error import URLError

    from blockflow.backend import parts
    from blockflow.plan import parse_plan_text

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def offline(*args: object, **kwargs: object) -> None:
        raise URLError("no network")

    monkeypatch.setattr(parts.torch.hub, "load_state_dict_from_url", offline)  # the machine is offline
    plan = parse_plan_text(TRAINED_PLAN, source="trained.yaml")
    trained = trained_weights("resnet18", "IMAGENET1K_V1")
    with pytest.raises(BlockError, match=f"not in torch hub's cache and could not be downloaded.*download {re.escape(trained.url)} "
                                         f"and put it at {re.escape(trained.cached)}"):
        BlockRunner(block_spec(plan, plan.blocks["a"], "triton-gpu"), CPU)


@pytest.mark.parametrize(("weights", "fragment"), [
    ("{torchvision: IMAGENET9K}", "has no weights named 'IMAGENET9K'; it has DEFAULT, IMAGENET1K_V1"),
    ("{torchvision: DEFAULT, seed: 1}", "give exactly one of seed, file or torchvision, not seed and torchvision"),
])
def test_trained_weights_are_checked_with_the_plan(weights: str, fragment: str) -> None:
    from blockflow.plan import parse_plan_text

    with pytest.raises(PlanError, match=re.escape(fragment)):
        parse_plan_text(TRAINED_PLAN.replace("{torchvision: DEFAULT}", weights), source="trained.yaml")
    with pytest.raises(PlanError, match="have 1000 classes, the model 10"):
        parse_plan_text(TRAINED_PLAN.replace("input_shape: [3, 64, 64]}", "input_shape: [3, 64, 64], num_classes: 10}"),
                        source="trained.yaml")
