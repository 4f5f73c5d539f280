"""Base networks and how they are cut into stages.

A base network is flattened into an ordered list of named top-level modules
(for ResNets: ``conv1 … layer4, avgpool, flatten, fc``). A plan's cut points
name modules of that list; stage ``i`` runs from just after cut ``i-1`` up to
and including cut ``i``, and the last stage runs to the end. Running the
stages one after another is exactly the unsplit forward pass.

Seeded weights are made by building the whole network under a fixed seed and
then slicing it, so a block's weights equal the same stages of the full model
built with that seed, in every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
from torch import nn

RESNET_SEQUENCE: Final = (
    "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "flatten", "fc",
)

SEQUENCES: Final[dict[str, tuple[str, ...]]] = {
    "resnet18": RESNET_SEQUENCE,
    "resnet34": RESNET_SEQUENCE,
    "resnet50": RESNET_SEQUENCE,
    "resnet101": RESNET_SEQUENCE,
    "resnet152": RESNET_SEQUENCE,
}

SUPPORTED_ARCHS: Final = tuple(sorted(SEQUENCES))


def module_sequence(arch: str) -> tuple[str, ...]:
    """The ordered module names of ``arch`` (``KeyError`` if unknown)."""
    return SEQUENCES[arch]


def stage_slices(arch: str, cut_points: Sequence[str]) -> list[tuple[int, int]]:
    """Half-open index ranges into :func:`module_sequence`, one per stage.

    Assumes cut points were validated (known, strictly increasing, not last).
    """
    seq = module_sequence(arch)
    bounds = [seq.index(c) + 1 for c in cut_points]
    starts = [0, *bounds]
    ends = [*bounds, len(seq)]
    return list(zip(starts, ends, strict=True))


def build_network(arch: str, num_classes: int, seed: int) -> nn.Module:
    """The whole torchvision network with weights drawn from ``seed`` (CPU, eval mode).

    The global RNG is forked so building a block never disturbs the caller's.
    """
    import torchvision.models as tvm

    factory = getattr(tvm, arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net: nn.Module = factory(weights=None, num_classes=num_classes)
    return net.eval()


def _named_module(net: nn.Module, name: str) -> nn.Module:
    if name == "flatten":
        return nn.Flatten(1)
    module: nn.Module = getattr(net, name)
    return module


def slice_stages(net: nn.Module, arch: str, cut_points: Sequence[str], first: int, last: int) -> nn.Sequential:
    """Stages ``first..last`` (inclusive) of ``net`` as one ``nn.Sequential`` sharing its parameters."""
    slices = stage_slices(arch, cut_points)
    start, end = slices[first][0], slices[last][1]
    seq = module_sequence(arch)
    return nn.Sequential(*(_named_module(net, n) for n in seq[start:end])).eval()


def stage_output_shapes(
    arch: str, cut_points: Sequence[str], input_shape: Sequence[int], num_classes: int
) -> list[tuple[int, ...]]:
    """Per-sample output shape of every stage, computed on the meta device (no weights, no compute)."""
    import torchvision.models as tvm

    with torch.device("meta"):
        net = getattr(tvm, arch)(weights=None, num_classes=num_classes).eval()
        x = torch.empty((1, *input_shape))
        shapes = []
        for i in range(len(cut_points) + 1):
            x = slice_stages(net, arch, cut_points, i, i)(x)
            shapes.append(tuple(int(d) for d in x.shape[1:]))
    return shapes
