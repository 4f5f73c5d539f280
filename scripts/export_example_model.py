"""Export a small network of one's own with ``torch.export``, the way a user brings a model to BlockFlow.

    python scripts/export_example_model.py plans/examples/skipnet.pt2

The network has a skip connection that spans most of it (the stem's output is added back before
the head, as in a U-Net), so a cut in the middle carries two tensors. Its weights are drawn from a
fixed seed: the same file on every machine. What matters for any model:

- export in eval mode (batch norm then uses its running statistics);
- make the batch dimension dynamic (``dynamic_shapes``), and only that one: a block serves any
  batch up to its ``max_batch_size``;
- one tensor in, one tensor out.

``--tuned FILE`` also writes other weights for the layers after ``body`` (``up``, ``head``) as a
safetensors file keyed like the program's ``state_dict``: a second task's own head, next to the
first. ``--blocks DIR`` also writes the network cut after ``down`` and ``body`` into one file per
stage, as an optimizer that cuts models itself hands them over: ``stageN.pt2`` (exported programs)
and ``stageN.ts`` (TorchScript, as the research prototype stored its blocks); see
``plans/examples/skipnet_stages.yaml``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class SkipNet(nn.Module):
    """stem → down → body → up (+ stem, the long skip) → head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.body = nn.Sequential(Residual(32), Residual(32))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(32, 16, 1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.head(self.up(self.body(self.down(s))) + s)


def build(seed: int = 0) -> SkipNet:
    """The network with weights (and batch-norm statistics) drawn from ``seed``, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = SkipNet()
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):  # statistics other than 0 and 1, so a mistake shows
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def export(net: nn.Module, shape: tuple[int, ...] = (3, 32, 32)) -> torch.export.ExportedProgram:
    """``net`` exported with a dynamic batch (1 to 1024)."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    return torch.export.export(net, (torch.randn(2, *shape),), dynamic_shapes=({0: batch},))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path, help="the .pt2 file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tuned", type=Path, help="also write other weights for up and head to this .safetensors file")
    ap.add_argument("--blocks", type=Path, help="also write the network cut into one .pt2 per block in this directory")
    args = ap.parse_args()
    net = build(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(export(net), args.output)
    print(f"wrote {args.output}")
    if args.tuned is not None:
        from safetensors.torch import save_file

        tuned = build(args.seed + 1).state_dict()
        save_file({k: v.contiguous() for k, v in tuned.items() if k.startswith(("up.", "head."))}, args.tuned)
        print(f"wrote {args.tuned}")
    if args.blocks is not None:
        args.blocks.mkdir(parents=True, exist_ok=True)
        # Each stage its own program: stem+down, body, up+skip+head. The skip crosses both cuts, so
        # the later stages take two tensors and the middle one hands the skip on.
        parts: list[tuple[str, nn.Module, tuple[tuple[int, ...], ...]]] = [
            ("stage0", _Front(net), ((3, 32, 32),)),
            ("stage1", _Middle(net), ((32, 16, 16), (16, 32, 32))),
            ("stage2", _Back(net), ((32, 16, 16), (16, 32, 32))),
        ]
        for name, part, shapes in parts:
            batch = torch.export.Dim("batch", min=1, max=1024)
            example = tuple(torch.randn(2, *s) for s in shapes)
            program = torch.export.export(part.eval(), example, dynamic_shapes=tuple({0: batch} for _ in shapes))
            torch.export.save(program, args.blocks / f"{name}.pt2")
            torch.jit.save(torch.jit.trace(part.eval(), example), args.blocks / f"{name}.ts")
            print(f"wrote {args.blocks / name}.pt2 and .ts")


class _Front(nn.Module):
    def __init__(self, net: SkipNet) -> None:
        super().__init__()
        self.stem, self.down = net.stem, net.down

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.stem(x)
        return self.down(s), s


class _Middle(nn.Module):
    def __init__(self, net: SkipNet) -> None:
        super().__init__()
        self.body = net.body

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x), s


class _Back(nn.Module):
    def __init__(self, net: SkipNet) -> None:
        super().__init__()
        self.up, self.head = net.up, net.head

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(x) + s)


if __name__ == "__main__":
    main()
