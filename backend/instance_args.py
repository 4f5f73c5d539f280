"""What Triton tells one block instance at ``initialize``: its model's spec (a parameter of its
``config.pbtxt``, written by the generator), the tensor names that spec gives it, and the device
Triton placed it on."""

from __future__ import annotations

import json
from typing import Any

import torch

from blockflow.core.errors import BlockError
from blockflow.core.spec import ACTIVATION_IN, ACTIVATION_OUT, IMAGE, SPEC_PARAMETER, ModelSpec, activation_names


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    try:
        raw = config["parameters"][SPEC_PARAMETER]["string_value"]
        return ModelSpec.model_validate(json.loads(raw))
    except (KeyError, ValueError) as exc:
        raise BlockError(f"model {config.get('name')!r} has no valid {SPEC_PARAMETER!r} parameter "
                         f"(regenerate the repository with `blockflow generate`): {exc}") from exc


def tensor_names(spec: ModelSpec) -> tuple[list[str], list[str]]:
    """Triton's input and output tensor names: a TensorMQ hop is one ticket per sample whatever it
    carries; other hops have one tensor per value that crosses the cut. Side inputs come after the
    hop's, each by its own name (on every transport: they never cross a hop)."""
    tmq = spec.transport == "tensormq"
    ins = [IMAGE] if spec.takes_image else activation_names(ACTIVATION_IN, 1 if tmq else len(spec.in_shapes))
    ins += [s.name for s in spec.side_inputs]
    outs = [o.name for o in spec.task_outputs] if spec.gives_logits or spec.answers_task else activation_names(ACTIVATION_OUT, 1 if tmq else len(spec.out_shapes))
    return ins, outs


def device(args: dict[str, str]) -> torch.device:
    if args.get("model_instance_kind") == "GPU":
        if not torch.cuda.is_available():
            raise BlockError("Triton placed this instance on a GPU but torch sees no CUDA device")
        return torch.device("cuda", int(args["model_instance_device_id"]))
    return torch.device("cpu")
