"""A plan's side inputs: task inputs besides the image (an exported program's further arguments, a
detector's ORIGINAL_SIZE; docs/plan.md "Task inputs besides the image"): which each model takes,
each block and its stages read, each task sends.

They are methods of :class:`blockflow.plan.deployment.Plan` (``plan.task_side_inputs(task)``),
mixed in from :class:`SideInputs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from blockflow.core import side_inputs as network_sides
from blockflow.core.spec import ORIGINAL_SIZE, SideInput
from blockflow.plan.schema import ModelDef

if TYPE_CHECKING:  # deployment imports this module: its classes are named for the types only
    from blockflow.plan.deployment import Block, Task


class SideInputs:
    """The side-input queries of a plan, over its resolved ``models`` and ``blocks``."""

    if TYPE_CHECKING:  # the plan's, resolved (:class:`~blockflow.plan.deployment.Plan` has them)
        @property
        def models(self) -> Mapping[str, ModelDef]: ...

        @property
        def blocks(self) -> Mapping[str, Block]: ...

    def model_side_inputs(self, model: str) -> tuple[SideInput, ...]:
        """Every task input besides the image that ``model``'s network takes, in its argument order
        (an exported program's further arguments; a detector's ORIGINAL_SIZE where its ``input`` asks; none
        for other torchvision networks and stage files)."""
        m = self.models[model]
        if m.original_size:
            return (SideInput(name=ORIGINAL_SIZE, dtype="int64", shape=(2,)),)
        if m.program is None or m.stage_files is not None:
            return ()
        return network_sides.side_inputs(m.network, tuple(m.input_shape), m.num_classes)

    def block_side_inputs(self, block: Block) -> tuple[str, ...]:
        """The side inputs ``block`` reads: those its stages read, in the order they take them; a detector's
        last block, ORIGINAL_SIZE (read by the block after its stages, never by a stage: see :meth:`stage_side_inputs`)."""
        m = self.models[block.model]
        if m.original_size:
            return (ORIGINAL_SIZE,) if block.last == m.stage_count - 1 else ()
        if not self.model_side_inputs(block.model):
            return ()
        return network_sides.stage_side_inputs(m.network, tuple(m.cut_points), tuple(m.input_shape), m.num_classes,
                                               block.first, block.last)

    def stage_side_inputs(self, block: Block) -> tuple[str, ...]:
        """The side inputs ``block``'s stage modules take (``Part.side_inputs``): all it reads but ORIGINAL_SIZE."""
        return tuple(n for n in self.block_side_inputs(block) if n != ORIGINAL_SIZE)

    def side_inputs_of(self, blocks: Sequence[Block]) -> tuple[SideInput, ...]:
        """The side inputs some of ``blocks`` read (a fused segment's, a whole path's): model by model
        in the order the blocks come, each model's in its network's argument order, each name once."""
        read = {name for b in blocks for name in self.block_side_inputs(b)}
        out: dict[str, SideInput] = {}
        for model in dict.fromkeys(b.model for b in blocks):
            out.update((s.name, s) for s in self.model_side_inputs(model) if s.name in read and s.name not in out)
        return tuple(out.values())

    def task_side_inputs(self, task: Task) -> tuple[SideInput, ...]:
        """What ``task`` takes besides its image: the side inputs its path reads (the plan's checks
        make one name mean one dtype and shape along it)."""
        return self.side_inputs_of([self.blocks[b] for b in task.path])
