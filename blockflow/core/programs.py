"""A user's own model exported with ``torch.export`` (a ``.pt2`` file), named by its path.

An exported program already is a graph: it is served as ``blockflow.core.arch`` cuts any network,
each node's module path coming from its ``nn_module_stack``. It brings its own weights, takes a
floating-point tensor with a dynamic batch first (only that dimension dynamic: the image), and gives
one or more tensors with the batch first; what it gives per sample is the value the export recorded.
Its outputs answer under the keys of the dict it returns, where Triton takes them as names.

Its further arguments, if any, are side inputs (``program_side_inputs``): task inputs of a fixed
per-sample shape, fp32 or int64, that reach each stage reading them straight from the task, never
across a hop; each answers to its argument's name.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any

import torch
from torch import fx

from blockflow.core.cuts import HopTensor
from blockflow.core.spec import SideDtype, SideInput

PROGRAM_SUFFIX = ".pt2"

# Set by ``load_program`` on the module it gives: whether its arguments after the first are side
# inputs (a whole program) or tensors entering it across a hop (a pre-cut stage file).
SIDE_INPUTS_ATTR = "_blockflow_side_inputs"
# Set by ``load_program``: each input's argument name as the model's ``forward`` spells it (export
# lower-cases its placeholders' names), None for a part of an argument that is a container.
ARG_NAMES_ATTR = "_blockflow_arg_names"


def is_program(network: str) -> bool:
    """Whether ``network`` names an exported program file rather than a torchvision model."""
    return network.endswith(PROGRAM_SUFFIX)


def load_program(path: str, single: bool = True) -> fx.GraphModule:
    """The exported program at ``path`` as a graph module with its own weights (CPU).

    ``torch.export.load`` runs no Python code from the file. ``single``: a whole model, whose
    arguments after the first (the image) are side inputs (``program_side_inputs`` checks them);
    else a pre-cut stage, each of whose arguments is a tensor entering it. Raises ``ValueError``
    (saying why and what to do) for a file that is not an exported program.
    """
    try:
        program = torch.export.load(path)
    except Exception as exc:  # a missing, truncated or foreign file: torch raises many kinds
        raise ValueError(f"cannot load exported program {path}: {type(exc).__name__}: {exc}; "
                         "save it with torch.export.save(torch.export.export(model, ...), path)") from None
    module = program.module()
    for node in list(module.graph.nodes):
        # The input guards torch.export adds check shapes against the export's constraints; the
        # blocks check their inputs' shapes themselves, and a stage has no such module.
        if node.op == "call_module" and str(node.target).startswith("_guards_fn") and not node.users:
            module.graph.erase_node(node)
        # A ``.to(dtype)`` is exported with an assertion of the tensor's dtype and device as exported
        # (the CPU): a block runs the same nodes on its GPU, and in its own precision.
        elif node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            module.graph.erase_node(node)
    module.recompile()
    setattr(module, SIDE_INPUTS_ATTR, single)
    setattr(module, ARG_NAMES_ATTR, _argument_names(program))
    return module


def _argument_names(program: torch.export.ExportedProgram) -> tuple[str | None, ...] | None:
    """The ``forward`` argument name of each input of ``program`` (None for each tensor of an
    argument that holds several); None where the program does not record them."""
    signature = program.module_call_graph[0].signature if program.module_call_graph else None
    names = getattr(signature, "forward_arg_names", None)  # recorded by torch >= 2.5
    in_spec = program.call_spec.in_spec
    if names is None or in_spec is None or in_spec.num_children != 2:
        return None
    args, kwargs = _children(in_spec)
    arguments = [*_children(args), *_children(kwargs)]
    if len(arguments) != len(names):
        return None
    return tuple(n for name, spec in zip(names, arguments, strict=True)
                 for n in ([str(name)] if spec.is_leaf() else [None] * spec.num_leaves))


def _children(spec: Any) -> list[Any]:
    """A pytree spec's children (``children()`` in newer torch, ``children_specs`` in older)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module an exported node runs in ('' at top level)."""
    stack = node.meta.get("nn_module_stack")
    return str(list(stack.values())[-1][0]) if stack else ""


def program_input(module: fx.GraphModule, path: str) -> tuple[torch.SymInt, tuple[int, ...]]:
    """The batch size symbol and the per-sample shape of the first input (the image) of the program
    at ``path``; ``ValueError`` (saying how to export it) where that is no tensor BlockFlow can serve."""
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


# Each side input dtype as torch has it (and back).
SIDE_DTYPES: dict[SideDtype, torch.dtype] = {"fp32": torch.float32, "int64": torch.int64}
_SIDE_DTYPES: dict[torch.dtype, SideDtype] = {v: k for k, v in SIDE_DTYPES.items()}


def program_side_inputs(module: fx.GraphModule, path: str) -> tuple[SideInput, ...]:
    """The side inputs of the program at ``path``: its arguments after the first (the image), in
    order, each named by its argument. ``ValueError`` (saying how to export or rename it) unless each
    is a float32 or int64 tensor with the image's batch first and a fixed per-sample shape of at
    least one dimension, named as Triton takes it and neither BlockFlow's own name nor an output's."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) < 2:
        return ()
    batch, _ = program_input(module, path)
    outputs = next(n for n in module.graph.nodes if n.op == "output").args[0]
    taken = set(program_output_names(path, len(outputs) if isinstance(outputs, (tuple, list)) else 1))
    export = ("export it so: batch = torch.export.Dim('batch'); torch.export.export(model, (image, side, ...), "
              "dynamic_shapes=({0: batch}, {0: batch}, ...))")
    names = getattr(module, ARG_NAMES_ATTR, None)
    if names is None or len(names) != len(placeholders):
        names = tuple(n.name for n in placeholders)
    sides: list[SideInput] = []
    for node, name in zip(placeholders[1:], names[1:], strict=True):
        value = node.meta.get("val")
        what = f"exported program {path}: side input {name or node.name!r}"
        if name is None:
            raise ValueError(f"{what} is part of an argument that holds several tensors; pass each side input "
                             "to the model's forward as a tensor argument of its own and export it again")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what} is no tensor; BlockFlow serves tensor inputs (pass it as a tensor [batch, ...])")
        if value.dtype not in _SIDE_DTYPES:
            raise ValueError(f"{what} is {str(value.dtype).removeprefix('torch.')}; a side input is float32 or int64: "
                             "export the model with it so (cast it inside the model if it needs another type)")
        if value.dim() == 0 or not isinstance(value.shape[0], torch.SymInt):
            raise ValueError(f"{what} has no dynamic batch first (shape {list(value.shape)}); give it the image's "
                             f"batch: {export}")
        if value.shape[0].node.expr != batch.node.expr:
            raise ValueError(f"{what} has a batch of its own; it must share the image's batch Dim: {export}")
        if value.dim() == 1:
            raise ValueError(f"{what} is one value per sample ([batch]); export it as [batch, 1] "
                             "(value.reshape(-1, 1) before exporting; reshape(-1) inside the model)")
        if not all(isinstance(d, int) for d in value.shape[1:]):
            raise ValueError(f"{what} has dynamic dimensions besides the batch; export it with a fixed per-sample "
                             f"shape (only dimension 0 dynamic): {export}")
        if not _triton_name(name) or name in taken:
            why = "is an output's name too" if name in taken else "is not a name a task input can take"
            raise ValueError(f"{what} {why}; rename the argument of the model's forward (letters, digits and _, "
                             "starting with a letter; not IMAGE, LOGITS, ORIGINAL_SIZE, ACTIVATION..., HANDED... nor an output's "
                             "name) and export it again")
        sides.append(SideInput(name=name, dtype=_SIDE_DTYPES[value.dtype], shape=tuple(int(d) for d in value.shape[1:])))
    return tuple(sides)


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


# A task output's or side input's name: what Triton and its clients call it (never a name the
# ensembles use themselves).
_TRITON_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
# ORIGINAL_SIZE: a detector's side input, which its block reads after its stages (blockflow.core.detection).
_RESERVED = {"IMAGE", "LOGITS", "ACTIVATION_IN", "ACTIVATION_OUT", "ORIGINAL_SIZE"}


def _triton_name(name: object) -> bool:
    return (isinstance(name, str) and bool(_TRITON_NAME.match(name)) and name not in _RESERVED
            and not name.startswith(("ACTIVATION", "HANDED")))


def program_output_names(path: str, count: int) -> list[str]:
    """The names a program's ``count`` outputs answer under: the keys of the dict it returns, where
    they are names Triton takes (letters, digits, ``_``; not BlockFlow's own), else ``OUTPUT_0``, ..."""
    st = os.stat(path)
    return list(_program_output_names(path, st.st_mtime_ns, st.st_size, count))


@lru_cache(maxsize=8)
def _program_output_names(path: str, mtime_ns: int, size: int, count: int) -> tuple[str, ...]:
    spec = torch.export.load(path).call_spec.out_spec
    keys = list(spec.context) if spec is not None and spec.type is dict else []
    if len(keys) == count and all(_triton_name(k) for k in keys):
        return tuple(keys)
    return tuple(f"OUTPUT_{i}" for i in range(count))
