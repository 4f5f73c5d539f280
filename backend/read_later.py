"""What a call of one request reads after answering it, not before.

A TensorMQ block answers a call of one request as soon as its tickets exist (``replies.EarlyReply``);
the next block's step then overlaps this block's remaining host work. What the answer does not
need moves behind it:

- the stream waits on the producers' slot events (the consumer still checks and claims every
  ticket before the answer, so a forged or replayed ticket is refused with an error, never
  answered with tickets);
- a first block's host images, taken through DLPack. Their shape is checked before the answer;
  their data type Triton checks against the model's config before the block sees the request.

``BLOCKFLOW_TMQ_READ_LATER=0`` reads everything before the answer (for comparisons).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

from blockflow.backend.tensormq.consumer import Consumer, SlotWait
from blockflow.core.errors import RequestError


class ReadLater:
    """One call's reads left for after its answer: slot waits, and host images by input position."""

    __slots__ = ("images", "waits")

    def __init__(self) -> None:
        self.waits: list[SlotWait] = []
        self.images: dict[int, Any] = {}  # position among the request's inputs -> its pb_utils tensor, unread

    def image(self, position: int, tensor: Any, shape: Sequence[int]) -> torch.Tensor:
        """A stand-in for a host image until :meth:`read`: a tensor with its shape and no data (on
        the meta device, so that any use before it is read fails loudly instead of reading nothing)."""
        self.images[position] = tensor
        return torch.empty(tuple(shape), dtype=torch.float32, device="meta")

    def read(self, xs: Sequence[torch.Tensor], stream: int, lap: Callable[[str], None] | None = None) -> list[torch.Tensor]:
        """``xs`` with its stand-ins read, once ``stream`` waits for the producers' slots."""
        Consumer.wait(self.waits, stream, lap, "run:wait")
        if not self.images:
            return list(xs)
        out = [from_dlpack(self.images[j].to_dlpack()) if j in self.images else x for j, x in enumerate(xs)]
        for j in self.images:
            if out[j].dtype != torch.float32 or out[j].shape != xs[j].shape:  # Triton checked both: never expected
                raise RequestError(f"input {j} is {out[j].dtype} {list(out[j].shape)}; expected torch.float32 {list(xs[j].shape)}")
        if lap is not None:
            lap("run:image")
        return out
