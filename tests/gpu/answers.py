"""When two answers to the same images count as the same on the GPU machine.

With one GPU, a block of these tests has one instance, and bytes that arrived intact give exactly its answer again.
With several (``placement: gpu``: an instance on each), the two calls may run in different processes, each with its
own cuDNN algorithms (``cudnn.benchmark``): 5e-4 of the largest logit apart on two H200s. Another image's answer is
2e-2 (the ResNet-50 of ``gpu_precisions.yaml``) to 0.3 (the ResNet-18 of ``small_plan``) away, so the tolerance
there sits between the two; a slightly short copy passes it, which the one-GPU machine's exact check catches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from blockflow.bench.agreement import relative_error

# Of the largest value: ten times two instances' rounding apart, a quarter of the nearest other image's answer.
ACROSS_INSTANCES = 5e-3


def rel_err(a: torch.Tensor | np.ndarray[Any, Any], b: torch.Tensor | np.ndarray[Any, Any]) -> float:
    """``relative_error`` of tensors of any device and dtype (bf16 has no NumPy type: both in float64)."""
    def f64(x: torch.Tensor | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return x.astype(np.float64) if isinstance(x, np.ndarray) else x.double().cpu().numpy()

    return relative_error(f64(a), f64(b))


def assert_same_answer(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    """``got`` equals ``want`` (one GPU) or is within :data:`ACROSS_INSTANCES` of it (several)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if torch.cuda.device_count() == 1:
        assert np.array_equal(got, want), f"relative error {rel_err(got, want):.2e}"
    else:
        err = rel_err(got, want)
        assert err <= ACROSS_INSTANCES, f"relative error {err:.2e} against the host input's answer"
