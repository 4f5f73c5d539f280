"""Exported programs that take task inputs besides the image (side inputs): the examples the side-input
tests serve, cut and whole."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class SizedBoxes(nn.Module):
    """Boxes in the pixels of each image's original ``size`` (int64 ``[B, 2]``: height, width), which
    only the last layers read."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Conv2d(8, 8, 3, padding=1)
        self.box = nn.Linear(8, 4)

    def forward(self, image: torch.Tensor, size: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(self.stem(image).relu()).relu().mean((2, 3))
        unit = self.box(h).sigmoid()  # x1, y1, x2, y2 in [0, 1] of the network's input
        scale = size.flip(1).repeat(1, 2).to(unit.dtype)  # (w, h, w, h)
        return {"boxes": unit * scale, "area": (size[:, 0] * size[:, 1]).reshape(-1, 1)}


class Scaled(nn.Module):
    """Logits of an image whose features are weighted by ``scale`` (fp32 ``[B, 1]``), which the first
    layers and the last read."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Conv2d(8, 8, 3, padding=1)
        self.cls = nn.Linear(8, 10)

    def forward(self, image: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = self.stem(image).relu() * scale.reshape(-1, 1, 1, 1)
        h = self.body(x).relu().mean((2, 3))
        return self.cls(h) + scale


def export(model: nn.Module, side: torch.Tensor, path: Path) -> Path:
    """``model`` (seeded weights) exported at ``path`` with a dynamic batch shared by both inputs."""
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, 0.0, 0.3)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model.eval(), (torch.randn(2, 3, 16, 16), side), dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, path)
    return path


def sized_boxes(where: Path) -> Path:
    return export(SizedBoxes(), torch.tensor([[480, 640], [32, 16]]), where / "sized_boxes.pt2")


def scaled(where: Path) -> Path:
    return export(Scaled(), torch.rand(2, 1) + 0.5, where / "scaled.pt2")
