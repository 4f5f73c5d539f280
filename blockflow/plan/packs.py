"""Packs of task heads: heads that run as one Triton model (``pack: heads`` or ``all``), one
process instead of one per head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blockflow.plan import naming

if TYPE_CHECKING:
    from blockflow.plan.deployment import Block, Plan


@dataclass(frozen=True)
class HeadPack:
    """Task heads that run as one model (``pack: heads`` or ``all``): one process instead of one per head.

    A task's *head* is the last deployed segment of its path when no other task uses any of
    its blocks. Heads that follow the same deployed segment, on the same transport and with the
    same deployment settings, form one pack; the pack answers each task on its own output.
    With ``pack: all`` a head that is the task's whole path (one segment, the image in, its
    model's output out) is packed too, with the other whole models of its model deployed alike
    (``after`` is empty: the pack takes the image). A group of more than ``pack_size`` heads is
    split into packs of nearly equal size. A head that reads a task input besides the image (a side
    input) is never packed.
    """

    name: str  # the pack's segment name, e.g. ``trunk__heads`` (before any transport suffix)
    after: str  # the deployed segment every head takes its input from; "" for a pack of whole models
    tasks: tuple[str, ...]
    heads: tuple[tuple[Block, ...], ...]  # each task's head segment, in ``tasks`` order


def head_packs(plan: Plan) -> dict[str, HeadPack]:
    """Task name -> the pack its head (with ``pack: all``, or its whole model) runs in (empty
    with ``pack: none``)."""
    if plan.raw.pack == "none":
        return {}

    users = plan.sharing()
    groups: dict[tuple[Any, ...], list[tuple[str, tuple[Block, ...]]]] = {}
    for task in plan.tasks.values():
        segments = plan.segments(task)
        head = segments[-1]
        whole = len(segments) == 1
        if (whole and plan.raw.pack != "all") or any(users[b.name] != [task.name] for b in head):
            continue
        if plan.block_outputs(head[-1]):  # a detector answers several tensors; a pack, one per member
            continue
        if plan.side_inputs_of(head):  # a pack would take every member's, which one task's request lacks
            continue
        after = "" if whole else naming.segment_model([b.name for b in segments[-2]])
        first = head[0]
        key = (after, task.transport, first.model, first.placement, first.instances, first.max_batch_size,
               first.precision, first.cuda_graphs)
        groups.setdefault(key, []).append((task.name, head))
    out: dict[str, HeadPack] = {}
    named: dict[str, int] = {}
    for key, group in groups.items():
        after = str(key[0])
        for members in _split(group, plan.raw.pack_size):
            if len(members) < 2:
                continue  # a lone head stays a model of its own
            if after:
                named[after] = named.get(after, 0) + 1
                name = naming.head_pack(after, named[after])
            else:  # no segment before: named after its first member's own
                name = naming.model_pack(naming.segment_model([b.name for b in members[0][1]]))
            pack = HeadPack(name, after, tuple(t for t, _ in members), tuple(h for _, h in members))
            out.update(dict.fromkeys(pack.tasks, pack))
    return out


def _split(members: list[Any], size: int) -> list[list[Any]]:
    """``members`` in order, cut into the fewest groups of at most ``size``, of nearly equal size (a
    pack is as slow as its members together, so equal packs keep the slowest one short)."""
    count = -(-len(members) // size)
    small, larger = divmod(len(members), count)  # the first ``larger`` groups hold one more
    out, start = [], 0
    for i in range(count):
        end = start + small + (i < larger)
        out.append(members[start:end])
        start = end
    return out
