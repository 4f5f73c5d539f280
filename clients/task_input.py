"""What a task's ``IMAGE`` input takes (datatype and one image's shape, from its metadata), and the check
that images a client sends are of that kind: refused, never cast, when they are not."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from blockflow.core.errors import ClientError
from blockflow.core.spec import IMAGE


@dataclass(frozen=True)
class TaskInput:
    """What a task's ``IMAGE`` takes: Triton's datatype (``FP32`` or ``UINT8``) and one image's shape."""

    datatype: str = "FP32"
    shape: tuple[int, ...] | None = None  # None: not known (a model without an IMAGE input)

    @property
    def layout(self) -> Literal["CHW", "HWC"]:
        return "HWC" if self.shape is not None and len(self.shape) == 3 and self.shape[0] != 3 and self.shape[-1] == 3 else "CHW"

    @property
    def uint8(self) -> bool:
        return self.datatype == "UINT8"

    @staticmethod
    def of(meta: Any) -> TaskInput:
        """From a model's metadata (HTTP: a dict, gRPC: a message)."""
        inputs = meta["inputs"] if isinstance(meta, dict) else [
            {"name": i.name, "datatype": i.datatype, "shape": list(i.shape)} for i in meta.inputs]
        for i in inputs:
            if i["name"] == IMAGE:
                return TaskInput(str(i["datatype"]), tuple(int(d) for d in i["shape"])[-3:])
        return TaskInput()

    def check(self, task: str, images: Any) -> Any:
        """``images`` as the task takes them (contiguous; numpy stays numpy, torch stays torch). A float
        array for a uint8 task (or uint8 for a float one) is refused, never cast: the values would be
        scaled wrongly, not merely rounded."""
        shape = list(images.shape)
        want = f"[batch, {', '.join(map(str, self.shape))}]" if self.shape else "[batch, 3, H, W]"
        if len(shape) != 4 or (tuple(shape[1:]) != self.shape if self.shape else shape[1] != 3):
            raise ClientError(f"images for {task!r} must be {want}; got shape {shape}")
        is_u8 = str(images.dtype).removeprefix("torch.") == "uint8"
        if self.uint8 != is_u8:
            got = str(images.dtype).removeprefix("torch.")
            raise ClientError(f"task {task!r} takes {'uint8' if self.uint8 else 'float32'} images {want}, got {got}: "
                              + ("send the image's uint8 values (blockflow.clients.images.load_image_uint8), "
                                 "not normalised floats; the task normalises them on the GPU" if self.uint8 else
                                 "send float32 images normalised as the model expects (blockflow.clients.images.load_image)"))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(images, torch.Tensor):
            return images.detach().to(torch.uint8 if self.uint8 else torch.float32).contiguous()
        return np.ascontiguousarray(images, dtype=np.uint8 if self.uint8 else np.float32)
