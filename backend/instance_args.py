"""What Triton tells one block instance at ``initialize``: its model's spec (a parameter of its
``config.pbtxt``, written by the generator) and the device Triton placed it on."""

from __future__ import annotations

import json
from typing import Any

import torch

from blockflow.core.errors import BlockError
from blockflow.core.spec import SPEC_PARAMETER, ModelSpec


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    try:
        raw = config["parameters"][SPEC_PARAMETER]["string_value"]
        return ModelSpec.model_validate(json.loads(raw))
    except (KeyError, ValueError) as exc:
        raise BlockError(f"model {config.get('name')!r} has no valid {SPEC_PARAMETER!r} parameter "
                         f"(regenerate the repository with `blockflow generate`): {exc}") from exc


def device(args: dict[str, str]) -> torch.device:
    if args.get("model_instance_kind") == "GPU":
        if not torch.cuda.is_available():
            raise BlockError("Triton placed this instance on a GPU but torch sees no CUDA device")
        return torch.device("cuda", int(args["model_instance_device_id"]))
    return torch.device("cpu")
