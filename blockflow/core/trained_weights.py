"""torchvision's trained weights by name (``weights: {torchvision: IMAGENET1K_V2}``): what its weights API calls
them, where they download from, and where torch hub keeps them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

import torch


@dataclass(frozen=True)
class TrainedWeights:
    """One of torchvision's trained weights for a model: its canonical name, where it downloads from, and the
    file it is kept in, in torch hub's cache (``$TORCH_HOME/hub/checkpoints``)."""

    name: str
    url: str
    num_classes: int

    @property
    def cached(self) -> str:
        return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(self.url).path))


def trained_weights(arch: str, name: str) -> TrainedWeights:
    """torchvision's weights ``name`` (``IMAGENET1K_V2``, or an alias such as ``DEFAULT``) of model ``arch``;
    ValueError naming the ones there are."""
    import torchvision.models as tvm

    try:
        enum = tvm.get_model_weights(arch)
    except ValueError:
        raise ValueError(f"torchvision has no trained weights for {arch!r}") from None
    try:
        w = enum[name]
    except KeyError:
        names = ", ".join(["DEFAULT", *(m.name for m in enum)])
        raise ValueError(f"torchvision's {arch} has no weights named {name!r}; it has {names}") from None
    return TrainedWeights(w.name, w.url, len(w.meta.get("categories") or ()))
