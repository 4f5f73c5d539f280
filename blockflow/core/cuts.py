"""Where a network can be cut: each legal cut and the tensors that would cross it (found by
``blockflow.core.arch.legal_cuts``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockflow.core.spec import SideInput


@dataclass(frozen=True)
class HopTensor:
    """One tensor that crosses a cut: its per-sample shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_sample(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Cut:
    """A place a network can be cut: after module (or node) ``name``; ``tensors`` cross it."""

    name: str
    tensors: tuple[HopTensor, ...]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(t.shape for t in self.tensors)

    @property
    def bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.tensors)


@dataclass(frozen=True)
class Cuts:
    """The legal cuts of one network at one input shape, in network order, its output's shape and
    its side inputs."""

    cuts: tuple[Cut, ...]
    ends: tuple[int, ...]  # index of each cut's last node in the traced graph
    output_shape: tuple[int, ...]
    input_shape: tuple[int, ...] = ()
    # A network of several outputs (an exported program's): each one's per-sample shape and dtype;
    # empty for one (``output_shape``).
    outputs: tuple[HopTensor, ...] = ()
    # Its side inputs (an exported program's arguments after the image: never carried by a hop), in
    # argument order, and the indices in the traced graph of the nodes that read each (where a
    # stage reads it: ``blockflow.core.side_inputs.stage_side_inputs``).
    sides: tuple[SideInput, ...] = ()
    side_users: tuple[tuple[int, ...], ...] = ()

    def names(self) -> list[str]:
        return [c.name for c in self.cuts]

    def get(self, name: str) -> Cut | None:
        return next((c for c in self.cuts if c.name == name), None)

    def at(self, names: Sequence[str], network: str) -> list[Cut]:
        """The cuts ``names``, in their order; ``ValueError`` for a name that is no legal cut of ``network``."""
        out = []
        for name in names:
            cut = self.get(name)
            if cut is None:
                raise ValueError(f"{name!r} is not a legal cut of {network}")
            out.append(cut)
        return out

    def position(self, name: str) -> int:
        """Where the cut falls in the network (cuts of modules that end together share a position)."""
        return self.ends[self.names().index(name)]
