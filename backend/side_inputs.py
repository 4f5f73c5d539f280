"""A block's side inputs: what a task gives beside the hop's tensors (a detector's images' original
sizes, a scale), taken after them, each in its declared dtype, float32 or int64.

Their checks, dtypes, zeros (a CUDA graph's static inputs, warm-up batches) and conversion to what
the block takes. Separate from :mod:`blockflow.backend.runtime` because the input path
(:mod:`blockflow.backend.request_inputs`) checks them too, before a call reaches the runner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockflow.core import detection
from blockflow.core.errors import RequestError
from blockflow.core.programs import SIDE_DTYPES
from blockflow.core.spec import ORIGINAL_SIZE, SideInput


def check_sides(xs: Sequence[torch.Tensor], sides: Sequence[SideInput], dtypes: Sequence[torch.dtype], batch: int) -> None:
    """Each side input in its declared dtype and per-sample shape, ``batch`` samples (its hop tensors'):
    a ``RequestError`` naming the first that is not."""
    for x, side, dtype in zip(xs, sides, dtypes, strict=True):
        if x.dtype != dtype or tuple(x.shape[1:]) != side.shape or int(x.shape[0]) != batch:
            raise RequestError(f"input {side.name!r} is {x.dtype} {list(x.shape)}; "
                               f"expected {dtype} [{batch}, {', '.join(map(str, side.shape))}]")
        # Its values where they are in host memory (a check on a GPU would wait for it; there they are clamped).
        if side.name == ORIGINAL_SIZE and not x.is_cuda:
            bad = ((x < 1) | (x > detection.MAX_ORIGINAL_SIDE)).any(dim=1).nonzero()
            if len(bad):
                row = int(bad[0, 0])
                raise RequestError(f"input {ORIGINAL_SIZE!r} gives each image's height and width in pixels, 1 to "
                                   f"{detection.MAX_ORIGINAL_SIDE} each; sample {row} is {x[row].tolist()}")


def side_dtypes(sides: Sequence[SideInput]) -> list[torch.dtype]:
    """Each side input's declared dtype (what a request gives)."""
    return [SIDE_DTYPES[s.dtype] for s in sides]


def side_casts(dtypes: Sequence[torch.dtype], dtype: torch.dtype, mixed: bool) -> list[torch.dtype]:
    """What the block takes each side input as: floating ones in its ``dtype``; their own where its parts'
    precisions are ``mixed`` (the chain casts each part's)."""
    return [d if not d.is_floating_point or mixed else dtype for d in dtypes]


def side_zeros(sides: Sequence[SideInput], dtypes: Sequence[torch.dtype], batch: int, device: torch.device) -> list[torch.Tensor]:
    """A zero of each side input, in its declared dtype (what a request gives)."""
    return [torch.zeros((batch, *s.shape), device=device, dtype=d) for s, d in zip(sides, dtypes, strict=True)]


def side_ins(xs: Sequence[torch.Tensor], casts: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The side inputs ``xs`` (on the block's device) as the block takes them: each in its cast (:func:`side_casts`)."""
    return [x.to(dtype=d).contiguous() for x, d in zip(xs, casts, strict=True)]
