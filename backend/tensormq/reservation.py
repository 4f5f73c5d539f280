"""What a TensorMQ producer hands its block: a reservation of pool memory for one batch, and the types
around it (its batch key, the error of a pool that stays full, the producer's counters and stable id)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.slots import Slot
from blockflow.core.errors import BlockError

Key = tuple[int, tuple[tuple[int, ...], ...], torch.dtype]  # a reservation's batch, per-sample shapes and dtype


def batch_bytes(key: Key) -> int:
    """Bytes of a batch of ``key``'s records, before the slot table's alignment."""
    batch, shapes, dtype = key
    return tk.record_offsets(shapes)[-1] * dtype.itemsize * batch


# A batch of at most this many samples is followed by its successor's reservation, prepared ahead.
PREPARE_MAX_BATCH = 1


class PoolExhaustedError(BlockError):
    """The producer's pool stayed full for the whole bounded wait; the request fails."""


def producer_id(name: str) -> int:
    """Stable 64-bit id of a model instance (it survives restarts; the generation does not)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


@dataclass
class Stats:
    allocations: int = 0
    tickets: int = 0
    releases: int = 0  # samples consumers released (from the claim table: counted when their slot is freed)
    stale_releases: int = 0
    lease_expiries: int = 0
    expired_tickets: int = 0
    pool_waits: int = 0
    pool_failures: int = 0
    hellos: int = 0
    unclaimed_tickets: int = 0  # samples reclaimed because no consumer claimed them in time
    early_tickets: int = 0  # tickets handed on before their batch's commit (Producer.issue)


@dataclass
class Reservation:
    slot: Slot
    views: list[torch.Tensor]  # one [batch, *shape] view in the pool per tensor
    sample_shape: tuple[int, ...]  # what each ticket describes (a record: all its elements)
    sample_bytes: int
    layout: int = 0  # ticket.layout_id of a record's tensors; 0 for one tensor
    key: Key | None = None  # (batch, shapes, dtype): what a prepared reservation can be taken for
    tickets: list[bytes] | None = None  # signed ahead, for a reservation prepared between calls
    packed: Any = None  # those tickets in the block's own form (the producer's ``pack``), made ahead with them
    issued: bool = False  # its tickets left the producer before the commit (Producer.issue)

    @property
    def view(self) -> torch.Tensor:
        """The view of a one-tensor reservation."""
        return self.views[0]
