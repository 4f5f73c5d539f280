"""Any torchvision model, cut at any legal place: the stages run one after another are the whole network."""

from __future__ import annotations

import pytest
import torch

from blockflow.core import arch

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


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize(("name", "shape"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_stages_chained_are_the_whole_network(name: str, shape: tuple[int, ...]) -> None:
    found = arch.legal_cuts(name, shape, 10)
    names = found.names()
    assert len(names) >= 3, names
    # Two cuts a third and two thirds of the way through, at different places in the network.
    cuts = [names[len(names) // 3], names[2 * len(names) // 3]]
    assert found.position(cuts[0]) < found.position(cuts[1])
    net = arch.build_network(name, 10, seed=3, input_shape=shape)
    stages = [arch.slice_stages(net, name, cuts, i, i) for i in range(3)]
    shapes = arch.stage_output_shapes(name, cuts, shape, 10)
    for batch in (1, 3):
        x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            whole = net(x)
            y = x
            for i, stage in enumerate(stages):
                y = stage(y)
                assert tuple(y.shape[1:]) == shapes[i], (i, y.shape, shapes[i])
        assert _rel_err(y, whole) <= 1e-5, (name, cuts, batch)
    # Two stages at once are the same as the two one after the other.
    both = arch.slice_stages(net, name, cuts, 1, 2)
    with torch.inference_mode():
        x = torch.randn(2, *shape)
        assert torch.equal(both(stages[0](x)), stages[2](stages[1](stages[0](x))))


def test_stages_keep_the_model_state_dict_names() -> None:
    net = arch.build_network("resnet18", 10, seed=1, input_shape=(3, 32, 32))
    head = arch.slice_stages(net, "resnet18", ["layer2"], 1, 1)
    keys = set(head.state_dict())
    assert "layer3.0.conv1.weight" in keys and "fc.weight" in keys
    assert not any(k.startswith(("conv1.", "layer1.", "layer2.")) for k in keys)
    assert keys <= set(net.state_dict())


def test_a_cut_where_two_values_cross_is_not_legal() -> None:
    names = arch.legal_cuts("resnet18", (3, 32, 32), 10).names()
    # Inside a residual block, after its first conv, the block's input is still needed by the add.
    assert "layer1.0.conv1" not in names and "layer1.0.bn1" not in names
    assert {"layer1", "layer2", "avgpool", "flatten"} <= set(names) and "fc" not in names


def test_an_input_the_network_cannot_take_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot take inputs of shape"):
        arch.legal_cuts("vit_b_16", (3, 32, 48), 10)
