"""Whether a node of a traced graph changes a value in place (a module with ``inplace=True``, a
method or function ending in ``_``, an augmented assignment, an aten op that writes its first
argument): a stage whose input another process owns clones it first (``blockflow.core.arch.stage_module``)."""

from __future__ import annotations

import operator

import torch
from torch import fx

_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift}


def mutates(node: fx.Node, value: fx.Node) -> bool:
    """Whether ``node`` may change ``value`` (its first argument) in place."""
    if not node.args or node.args[0] is not value:
        return False
    owner = node.graph.owning_module
    if node.op == "call_module" and owner is not None:
        return bool(getattr(owner.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):  # an exported graph's aten op
        first = node.target._schema.arguments[0] if node.target._schema.arguments else None
        return bool(first is not None and first.alias_info is not None and first.alias_info.is_write)
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return bool(node.kwargs.get("inplace")) or node.target in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
    return False
