"""Models an optimizer already cut: one file per stage, an exported program (``.pt2``) or a
TorchScript file, each with its weights; what one file gives, the next must take."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import fx, nn

from blockflow.core.arch import only_output, stage_module, trace
from blockflow.core.programs import is_program, load_program, recorded_tensor


def load_stage_file(path: str) -> nn.Module:
    """One pre-cut stage: an exported program (``.pt2``) or a TorchScript file, as a module that
    takes its tensors positionally (CPU, its own weights). ``ValueError`` if it does not load."""
    if is_program(path):
        traced = trace(load_program(path, single=False))
        return stage_module(traced, [], 0, 0)  # a plain GraphModule: no pytree calling convention, picklable
    try:
        with warnings.catch_warnings():
            # PyTorch deprecates TorchScript in favour of torch.export; files of it are still read here
            # (the research prototype stored its blocks so), and the docs point to .pt2.
            warnings.simplefilter("ignore", FutureWarning)
            script: nn.Module = torch.jit.load(path, map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception as exc:  # a missing, truncated or foreign file: torch raises many kinds
        raise ValueError(f"cannot load {path} as an exported program (.pt2) or a TorchScript file: "
                         f"{type(exc).__name__}: {exc}") from None
    _no_tf32_convolutions(script)
    return script.eval()


# aten::_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
#                    benchmark, deterministic, cudnn_enabled, allow_tf32)
_ALLOW_TF32 = 12


def _no_tf32_convolutions(script: nn.Module) -> None:
    """Make a traced file's convolutions follow the process's TF32 switch.

    ``torch.jit.trace`` records ``torch.backends.cudnn.allow_tf32`` as it was when tracing (True
    by default) as a constant of every convolution, so on a GPU a fp32 block would convolve in
    TF32 (1.2e-4 from the program it was traced from) whatever the block's precision says. The
    constant becomes False: a fp32 block stays fp32; a tf32 block's convolutions run in fp32.
    """
    for module in script.modules():
        graph = getattr(getattr(module, "forward", None), "graph", None)
        if graph is None:
            continue
        for node in graph.findAllNodes("aten::_convolution"):
            if node.inputsSize() > _ALLOW_TF32:
                with graph.insert_point_guard(node):  # the constant must come before its use
                    node.replaceInput(_ALLOW_TF32, graph.insertConstant(False))


Shapes = tuple[tuple[int, ...], ...]


def stage_file_shapes(paths: Sequence[str], input_shape: Sequence[int] | None) -> list[tuple[Shapes, Shapes]]:
    """(input shapes, output shapes) per sample of each pre-cut stage file, in order.

    An exported program records its shapes. A TorchScript file does not, so it is run once on
    zeros (batch 2, CPU) with what the previous file gives, or ``input_shape`` when it is the first.
    Raises ``ValueError`` naming the file.
    """
    out: list[tuple[Shapes, Shapes]] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        given = out[-1][1] if out else (None if input_shape is None else (tuple(input_shape),))
        out.append(_stage_file_shapes(path, st.st_mtime_ns, st.st_size, given))
    return out


@lru_cache(maxsize=64)
def _stage_file_shapes(path: str, mtime_ns: int, size: int, given: Shapes | None) -> tuple[Shapes, Shapes]:
    module = load_stage_file(path)
    if isinstance(module, fx.GraphModule):
        def per_sample(node: fx.Node) -> tuple[int, ...]:
            t = recorded_tensor(node)
            if t is None or not t.dtype.is_floating_point:
                raise ValueError(f"{path}: every input and output must be a floating-point tensor whose only dynamic "
                                 "dimension is the batch, first; export with dynamic_shapes={0: torch.export.Dim('batch')} "
                                 "for each input")
            return t.shape

        nodes = list(module.graph.nodes)
        ins = tuple(per_sample(n) for n in nodes if n.op == "placeholder")
        result = only_output(nodes[-1])
        outs = tuple(per_sample(n) for n in (result if isinstance(result, (tuple, list)) else (result,)))
        return ins, outs
    if given is None:
        raise ValueError(f"{path} is a TorchScript file, which does not record its input's shape; give the "
                         "model's input_shape")
    try:
        with torch.no_grad():
            result = module(*(torch.zeros(2, *s) for s in given))
    except Exception as exc:  # the script's own error for inputs it cannot take
        raise ValueError(f"{path} cannot take inputs of shape {' + '.join(str(list(s)) for s in given)}: {exc}") from None
    results = result if isinstance(result, (tuple, list)) else (result,)
    if not results or not all(isinstance(r, torch.Tensor) and r.dim() >= 1 and r.shape[0] == 2 and r.dtype.is_floating_point
                              for r in results):
        raise ValueError(f"{path} must return a floating-point tensor (or a tuple of them) with the batch first")
    return given, tuple(tuple(int(d) for d in r.shape[1:]) for r in results)
