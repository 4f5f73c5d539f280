"""A plan's hand-overs beyond the ensemble (plan option ``hand_over``: ``direct`` or ``chain``;
docs/plan.md): which deployed models hand over to which, on which tasks, and the warnings for tasks
that ask for them and find none. The pairs' rules are in :mod:`blockflow.plan.direct_pairs`.

They are methods of :class:`blockflow.plan.deployment.Plan` (``plan.task_hand_overs(task)``),
mixed in from :class:`HandOvers`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from blockflow.core.spec import ANSWER_MAX, LOGITS, SideInput, TaskOutput
from blockflow.plan import direct_pairs
from blockflow.plan.packs import HeadPack
from blockflow.plan.schema import HandOverMode, PlanModel

if TYPE_CHECKING:  # deployment imports this module: its classes are named for the types only
    from blockflow.plan.deployment import Block, Deployed, Task


class HandOvers:
    """The hand-over queries of a plan, over its resolved ``tasks``, deployed paths and head packs."""

    if TYPE_CHECKING:  # the plan's (:class:`~blockflow.plan.deployment.Plan` has them)
        @property
        def tasks(self) -> Mapping[str, Task]: ...

        @property
        def head_packs(self) -> Mapping[str, HeadPack]: ...

        def deployed(self, task: Task) -> list[Deployed]: ...

        def side_inputs_of(self, blocks: Sequence[Block]) -> tuple[SideInput, ...]: ...

        raw: PlanModel

        def block_outputs(self, block: Block) -> tuple[TaskOutput, ...]: ...

        def block_out_shape(self, block: Block) -> tuple[int, ...]: ...

    @cached_property
    def hand_overs(self) -> dict[str, str]:
        """Sender -> receiver of each pair of deployed models (names before any transport suffix) that
        hand over directly on the tasks that ask for it (``blockflow.plan.direct_pairs``)."""
        mode = self.hand_over_mode
        paths = {t.name: [d.name for d in self.deployed(t)] for t in self.tasks.values()
                 if t.hand_over == mode and mode != "ensemble" and t.transport == "tensormq"}
        if not paths:
            return {}
        kept = [[d.name for d in self.deployed(t)] for t in self.tasks.values() if t.name not in paths]
        readers = {d.name for t in self.tasks.values() for d in self.deployed(t) if self.side_inputs_of(d.blocks)}
        tails = self.chain_tails if mode == "chain" else set()
        return direct_pairs.pairs(paths, {p.name for p in self.head_packs.values()}, kept, readers, chain=mode == "chain",
                                  tails=tails)

    @cached_property
    def chain_tails(self) -> set[str]:
        """The deployed models that may end a chain as its tail (plan option ``chain_answers: head``): each
        task's last, where one sample's answer has a fixed size of at most ``ANSWER_MAX`` bytes."""
        if self.raw.chain_answers != "head":
            return set()
        out = set()
        for t in self.tasks.values():
            last = self.deployed(t)[-1]
            block = last.blocks[-1]
            answer = self.block_outputs(block) or (TaskOutput(name=LOGITS, dtype="fp32", shape=self.block_out_shape(block)),)
            sizes = [o.sample_bytes for o in answer]
            if last.pack is None and all(n is not None for n in sizes) and sum(n or 0 for n in sizes) <= ANSWER_MAX:
                out.add(last.name)
        return out

    @cached_property
    def hand_over_mode(self) -> HandOverMode:
        """How the plan's blocks hand over beyond the ensemble: ``direct``, ``chain`` (one of them per
        plan, checked when the plan is read) or ``ensemble`` (never)."""
        modes = {t.hand_over for t in self.tasks.values()} - {"ensemble"}
        return next(iter(modes)) if len(modes) == 1 else "ensemble"

    def task_hand_overs(self, task: Task) -> list[tuple[str, str]]:
        """The pairs of :meth:`hand_overs` on ``task``'s deployed path, in order."""
        relay = self.hand_overs
        path = [d.name for d in self.deployed(task)]
        return [(a, b) for a, b in zip(path, path[1:], strict=False) if relay.get(a) == b]

    def hand_over_warnings(self) -> list[str]:
        """Tasks that ask for direct hand-overs or chains where their path has none."""
        out = []
        for t in self.tasks.values():
            if t.hand_over == "ensemble":
                continue
            if t.transport != "tensormq":
                out.append(f"tasks.{t.name}: hand_over {t.hand_over!r} needs transport 'tensormq' (it is {t.transport!r}); "
                           "its blocks hand over through the ensemble")
            elif not self.task_hand_overs(t) and t.hand_over == "direct":
                out.append(f"tasks.{t.name}: hand_over 'direct' finds no pair on its path: a block must be the only one "
                           "after the other and the other the only one before it in every task, and the one that takes "
                           "over is no task's first, second or last block and reads no task input besides the image "
                           "(docs/plan.md)")
            elif not self.task_hand_overs(t):
                out.append(f"tasks.{t.name}: hand_over 'chain' finds no link on its path: a link is the only block after "
                           "the one before it and before the one after it in every task, no task's first or last block, "
                           "in no task that keeps its steps (hand_over 'ensemble', another transport) and reads no task "
                           "input besides the image (docs/plan.md)")
        return out + self._chain_answer_warnings()

    def _chain_answer_warnings(self) -> list[str]:
        """``chain_answers: head`` where it changes nothing: no chains, or tasks whose chain keeps its join."""
        if self.raw.chain_answers != "head":
            return []
        if self.hand_over_mode != "chain":
            return ["chain_answers: 'head' has no effect without hand_over: 'chain' (docs/plan.md, \"Chains\")"]
        out = []
        for t in self.tasks.values():
            pairs = self.task_hand_overs(t)
            last = self.deployed(t)[-1].name
            if t.hand_over == "chain" and pairs and pairs[-1][1] != last:
                out.append(f"tasks.{t.name}: chain_answers 'head' keeps its join {last!r}: a tail's answer has a fixed size "
                           f"of at most {ANSWER_MAX // 1024} KiB, it is in no pack, and it is last in every task that uses "
                           "it, after a link (docs/plan.md, \"Chains\")")
        return out
