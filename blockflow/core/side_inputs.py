"""A network's side inputs (an exported program's arguments after the image, found by
``blockflow.core.programs.program_side_inputs``) and which stages of a cut network read each.

A hop never carries one: each reaches every stage that reads it straight from the task, taken by
the stage module after its entering tensors (``blockflow.core.arch.stage_module``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from blockflow.core.arch import legal_cuts
from blockflow.core.spec import SideInput


def side_inputs(network: str, input_shape: Sequence[int], num_classes: int) -> tuple[SideInput, ...]:
    """The network's side inputs (an exported program's arguments after the image), in argument
    order; none for a torchvision network."""
    return legal_cuts(network, tuple(input_shape), num_classes).sides


def stage_side_inputs(network: str, cut_points: Sequence[str], input_shape: Sequence[int], num_classes: int,
                      first: int, last: int) -> tuple[str, ...]:
    """The names of the side inputs stages ``first..last`` (inclusive) of ``network`` cut at
    ``cut_points`` read, in argument order: what their stage module takes after its entering tensors."""
    cuts = legal_cuts(network, tuple(input_shape), num_classes)
    if not cuts.sides:
        return ()
    bounds = [cuts.position(c.name) for c in cuts.at(cut_points, network)]
    start = bounds[first - 1] + 1 if first > 0 else 0
    end = bounds[last] if last < len(bounds) else math.inf  # the last stage: to the output, which may read one
    return tuple(s.name for s, users in zip(cuts.sides, cuts.side_users, strict=True)
                 if any(start <= u <= end for u in users))
