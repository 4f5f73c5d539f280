"""A user's own model exported with ``torch.export`` (a ``.pt2`` file), named by its path.

An exported program already is a graph: it is served as ``blockflow.core.arch`` cuts any network,
each node's module path coming from its ``nn_module_stack``. It brings its own weights, takes one
floating-point tensor with a dynamic batch first (only that dimension dynamic), and gives one or
more tensors with the batch first; what it gives per sample is the value the export recorded.
Its outputs answer under the keys of the dict it returns, where Triton takes them as names.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

import torch
from torch import fx

from blockflow.core.cuts import HopTensor

PROGRAM_SUFFIX = ".pt2"


def is_program(network: str) -> bool:
    """Whether ``network`` names an exported program file rather than a torchvision model."""
    return network.endswith(PROGRAM_SUFFIX)


def load_program(path: str, single: bool = True) -> fx.GraphModule:
    """The exported program at ``path`` as a graph module with its own weights (CPU).

    ``torch.export.load`` runs no Python code from the file. Raises ``ValueError`` (saying why and
    what to do) for a file that is not an exported program (of one tensor in, when ``single``: a
    whole model; it may give several).
    """
    try:
        program = torch.export.load(path)
    except Exception as exc:  # a missing, truncated or foreign file: torch raises many kinds
        raise ValueError(f"cannot load exported program {path}: {type(exc).__name__}: {exc}; "
                         "save it with torch.export.save(torch.export.export(model, ...), path)") from None
    signature = program.graph_signature
    if single and len(signature.user_inputs) != 1:
        raise ValueError(f"exported program {path} takes {len(signature.user_inputs)} inputs; BlockFlow serves "
                         "programs of one tensor in (and one or more out)")
    module = program.module()
    for node in list(module.graph.nodes):
        # The input guards torch.export adds check shapes against the export's constraints; the
        # blocks check their inputs' shapes themselves, and a stage has no such module.
        if node.op == "call_module" and str(node.target).startswith("_guards_fn") and not node.users:
            module.graph.erase_node(node)
    module.recompile()
    return module


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module an exported node runs in ('' at top level)."""
    stack = node.meta.get("nn_module_stack")
    return str(list(stack.values())[-1][0]) if stack else ""


def program_input(module: fx.GraphModule, path: str) -> tuple[torch.SymInt, tuple[int, ...]]:
    """The batch size symbol and the per-sample shape of the one input of the program at ``path``;
    ``ValueError`` (saying how to export it) where that is no tensor BlockFlow can serve."""
    placeholder = next(n for n in module.graph.nodes if n.op == "placeholder")
    value = placeholder.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or not value.dtype.is_floating_point:
        raise ValueError(f"exported program {path} does not take a floating-point tensor with a batch dimension")
    batch = value.shape[0]
    if not isinstance(batch, torch.SymInt):
        raise ValueError(f"exported program {path} was exported for batches of exactly {batch}; export it with a "
                         "dynamic batch: torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim('batch')},))")
    if not all(isinstance(d, int) for d in value.shape[1:]):
        raise ValueError(f"exported program {path} has dynamic dimensions besides the batch; export it with a fixed "
                         "sample shape (only dimension 0 dynamic)")
    return batch, tuple(int(d) for d in value.shape[1:])


def recorded_tensor(node: fx.Node, batch: torch.SymInt | None = None) -> HopTensor | None:
    """What an exported node gives per sample, from the value the export recorded: None unless it is
    a tensor whose only dynamic dimension is the batch, first (``batch``'s symbol, when given)."""
    v = node.meta.get("val")
    if not (isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], torch.SymInt)
            and all(isinstance(d, int) for d in v.shape[1:])):
        return None
    if batch is not None and v.shape[0].node.expr != batch.node.expr:
        return None
    return HopTensor(tuple(int(d) for d in v.shape[1:]), v.dtype)


# A task output's name: what Triton and its clients call it (never a name the ensembles use themselves).
_OUTPUT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
_RESERVED = {"IMAGE", "LOGITS", "ACTIVATION_IN", "ACTIVATION_OUT"}


def program_output_names(path: str, count: int) -> list[str]:
    """The names a program's ``count`` outputs answer under: the keys of the dict it returns, where
    they are names Triton takes (letters, digits, ``_``; not BlockFlow's own), else ``OUTPUT_0``, ..."""
    st = os.stat(path)
    return list(_program_output_names(path, st.st_mtime_ns, st.st_size, count))


@lru_cache(maxsize=8)
def _program_output_names(path: str, mtime_ns: int, size: int, count: int) -> tuple[str, ...]:
    spec = torch.export.load(path).call_spec.out_spec
    keys = list(spec.context) if spec is not None and spec.type is dict else []
    if len(keys) == count and all(isinstance(k, str) and _OUTPUT_NAME.match(k) and k not in _RESERVED
                                  and not k.startswith(("ACTIVATION", "HANDED")) for k in keys):
        return tuple(keys)
    return tuple(f"OUTPUT_{i}" for i in range(count))
