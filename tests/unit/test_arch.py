"""Any torchvision model, cut at any legal place: the stages run one after another are the whole network."""

from __future__ import annotations

import pytest
import torch

from blockflow.core import arch

from ..conftest import tensor_error

# One network of each family the product promises, at the smallest input it takes (CPU time in CI).
FAMILIES = [
    ("mobilenet_v3_small", (3, 32, 32)),
    ("efficientnet_b0", (3, 32, 32)),
    ("convnext_tiny", (3, 32, 32)),
    ("vit_b_16", (3, 32, 32)),
    ("swin_t", (3, 64, 64)),
    ("densenet121", (3, 32, 32)),
    ("regnet_y_400mf", (3, 32, 32)),
    ("resnext50_32x4d", (3, 32, 32)),
]


def _chain(stages: list[torch.nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ys: tuple[torch.Tensor, ...] = (x,)
    for stage in stages:
        out = stage(*ys)
        ys = out if isinstance(out, tuple) else (out,)
    return ys


@pytest.mark.parametrize(("name", "shape"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_stages_chained_are_the_whole_network(name: str, shape: tuple[int, ...]) -> None:
    found = arch.legal_cuts(name, shape, 10)
    names = found.names()
    assert len(names) >= 3, names
    net = arch.build_network(name, 10, seed=3, input_shape=shape)
    # Two cuts a third and two thirds of the way through, at different places in the network; and
    # the cut where the most tensors cross (a skip connection, where the network has one).
    widest = max(found.cuts, key=lambda c: (len(c.tensors), -found.position(c.name))).name
    for cuts in ([names[len(names) // 3], names[2 * len(names) // 3]], [widest]):
        assert all(a < b for a, b in zip(map(found.position, cuts), map(found.position, cuts[1:]), strict=False))
        stages = [arch.slice_stages(net, name, cuts, i, i) for i in range(len(cuts) + 1)]
        shapes = arch.stage_output_shapes(name, cuts, shape, 10)
        for batch in (1, 3):
            x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(batch))
            with torch.inference_mode():
                whole = net(x)
                for i in range(len(stages)):
                    ys = _chain(stages[:i + 1], x)
                    assert tuple(tuple(y.shape[1:]) for y in ys) == shapes[i], (cuts, i, [y.shape for y in ys], shapes[i])
            assert float(whole.abs().max()) > 1e-3, "an output that does not depend on the input would test nothing"
            assert tensor_error(ys[0], whole) <= 1e-5, (name, cuts, batch)
    # Two stages at once are the same as the two one after the other.
    cuts = [names[len(names) // 3], names[2 * len(names) // 3]]
    stages = [arch.slice_stages(net, name, cuts, i, i) for i in range(3)]
    both = arch.slice_stages(net, name, cuts, 1, 2)
    with torch.inference_mode():
        x = torch.randn(2, *shape)
        assert torch.equal(_chain([stages[0], both], x)[0], _chain(stages, x)[0])


def test_stages_keep_the_model_state_dict_names() -> None:
    net = arch.build_network("resnet18", 10, seed=1, input_shape=(3, 32, 32))
    head = arch.slice_stages(net, "resnet18", ["layer2"], 1, 1)
    keys = set(head.state_dict())
    assert "layer3.0.conv1.weight" in keys and "fc.weight" in keys
    assert not any(k.startswith(("conv1.", "layer1.", "layer2.")) for k in keys)
    assert keys <= set(net.state_dict())


def test_a_cut_inside_a_residual_block_carries_the_skip() -> None:
    found = arch.legal_cuts("resnet18", (3, 32, 32), 10)
    # After a block's first conv, the block's input is still needed by its add: both cross.
    cut = found.get("layer1.0.conv1")
    assert cut is not None and cut.shapes == ((64, 8, 8), (64, 8, 8)) and cut.bytes_per_sample == 2 * 64 * 8 * 8 * 4
    between = found.get("layer1")
    assert between is not None and len(between.tensors) == 1
    assert {"layer1", "layer2", "avgpool", "flatten"} <= set(found.names()) and "fc" not in found.names()
    net = arch.build_network("resnet18", 10, seed=1, input_shape=(3, 32, 32))
    first = arch.slice_stages(net, "resnet18", ["layer1.0.conv1"], 0, 0)
    assert [n.name for n in first.graph.nodes if n.op == "output"] and isinstance(first(torch.zeros(1, 3, 32, 32)), tuple)


def test_an_input_the_network_cannot_take_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot take inputs of shape"):
        arch.legal_cuts("vit_b_16", (3, 32, 48), 10)


def test_a_stage_never_changes_its_inputs_in_place() -> None:
    """Inputs may be another process's read-only memory (a TensorMQ pool on the CPU): a stage that
    starts with an in-place op (ReLU(inplace=True) after ``bn1``; ``out += identity`` after a
    block's ``bn2``) works on a copy, and still gives the unsplit network's outputs."""
    net = arch.build_network("resnet18", 10, seed=2, input_shape=(3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        whole = net(x)
        for cut in ("bn1", "layer1.0.bn2"):
            first, second = (arch.slice_stages(net, "resnet18", [cut], i, i) for i in range(2))
            mid = first(x)
            mids = mid if isinstance(mid, tuple) else (mid,)
            kept = [m.clone() for m in mids]
            y = second(*mids)
            assert all(torch.equal(m, k) for m, k in zip(mids, kept, strict=True)), cut
            assert tensor_error(y, whole) <= 1e-6, cut
