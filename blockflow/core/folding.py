"""Constants folded into a traced graph: the input's size, which a network built for one input
shape reads without the batch (``blockflow.core.arch.trace``)."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx


def fold_input_size(graph: fx.Graph, input_shape: tuple[int, ...]) -> None:
    """Replace the input's size, where the network reads it without the batch (``x.shape[-2:]``),
    by its value: a segmentation network resizes its logits to it at the end, and a value live
    across every cut that is no tensor would leave no legal cut."""
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        rank = 1 + len(input_shape)
        for size in list(node.users):
            if not (size.op == "call_function" and size.target is getattr and size.args[1:] == ("shape",)):
                continue
            for user in list(size.users):
                if not (user.op == "call_function" and user.target is operator.getitem and user.args[0] is size):
                    continue
                index = user.args[1]
                if isinstance(index, slice) and not any(isinstance(v, fx.Node) for v in (index.start, index.stop, index.step)):
                    dims = range(rank)[index]
                    if 0 in dims:
                        continue
                    value: Any = torch.Size(input_shape[d - 1] for d in dims)
                elif isinstance(index, int) and index % rank != 0:
                    value = input_shape[index % rank - 1]
                else:
                    continue
                replace_uses(user, value)
                graph.erase_node(user)
            if not size.users:
                graph.erase_node(size)
    graph.lint()


def replace_uses(node: fx.Node, value: Any) -> None:
    """Make every user of ``node`` take the constant ``value`` instead."""
    def swap(a: Any) -> Any:
        return value if a is node else a

    for use in list(node.users):
        use.args = tuple(fx.node.map_aggregate(use.args, swap))
        use.kwargs = dict(fx.node.map_aggregate(use.kwargs, swap))
