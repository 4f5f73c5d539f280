"""What a task's ``IMAGE`` input takes (datatype and one image's shape, from its metadata), and the check
that images a client sends are of that kind: refused, never cast, when they are not. A task whose plan
says ``input: {dtype: encoded}`` takes JPEG or PNG files' bytes (Triton BYTES ``[batch, 1]``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import numpy as np

from blockflow.core.errors import ClientError
from blockflow.core.spec import IMAGE


@dataclass(frozen=True)
class TaskInput:
    """What a task's ``IMAGE`` takes: Triton's datatype (``FP32``, ``UINT8``, or ``BYTES``: encoded
    files) and one image's shape (``(1,)`` for encoded: one file's bytes)."""

    datatype: str = "FP32"
    shape: tuple[int, ...] | None = None  # None: not known (a model without an IMAGE input)

    @property
    def layout(self) -> Literal["CHW", "HWC"]:
        return "HWC" if self.shape is not None and len(self.shape) == 3 and self.shape[0] != 3 and self.shape[-1] == 3 else "CHW"

    @property
    def uint8(self) -> bool:
        return self.datatype == "UINT8"

    @property
    def encoded(self) -> bool:
        return self.datatype == "BYTES"

    @staticmethod
    def of(meta: Any) -> TaskInput:
        """From a model's metadata (HTTP: a dict, gRPC: a message)."""
        inputs = meta["inputs"] if isinstance(meta, dict) else [
            {"name": i.name, "datatype": i.datatype, "shape": list(i.shape)} for i in meta.inputs]
        for i in inputs:
            if i["name"] == IMAGE:
                shape = tuple(int(d) for d in i["shape"])
                return TaskInput(str(i["datatype"]), (1,) if i["datatype"] == "BYTES" else shape[-3:])
        return TaskInput()

    def check(self, task: str, images: Any) -> Any:
        """``images`` as the task takes them (contiguous; numpy stays numpy, torch stays torch). A float
        array for a uint8 task (or uint8 for a float one) is refused, never cast: the values would be
        scaled wrongly, not merely rounded. For an encoded task: the files' bytes as an object array
        ``[batch, 1]`` (given as bytes, a sequence of bytes, or such an array); arrays of pixels are refused."""
        listed = isinstance(images, (list, tuple))
        if self.encoded:
            files = listed or isinstance(images, (bytes, bytearray)) or getattr(images, "dtype", None) == np.object_
            return _files(task, images) if files else self._refuse_pixels(task, images)
        if isinstance(images, (bytes, bytearray)) or getattr(images, "dtype", None) == np.object_ or (
                listed and any(isinstance(b, (bytes, bytearray)) for b in images)):
            raise ClientError(f"task {task!r} takes {'uint8' if self.uint8 else 'float32'} image arrays, not encoded files' "
                              "bytes: decode them first (blockflow.clients.images.load_image"
                              f"{'_uint8' if self.uint8 else ''}), or serve the model with input: {{dtype: encoded}}")
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

    @staticmethod
    def _refuse_pixels(task: str, images: Any) -> NoReturn:
        got = str(getattr(images, "dtype", type(images).__name__)).removeprefix("torch.")
        raise ClientError(f"task {task!r} takes encoded images (JPEG or PNG files' bytes, one per image), got a {got} "
                          "array: send the files as they are (blockflow.clients.images.image_files), not decoded pixels")


def _files(task: str, images: Any) -> Any:
    """Encoded ``images`` as the object array ``[batch, 1]`` of bytes a BYTES input takes."""
    items = [images] if isinstance(images, (bytes, bytearray)) else list(np.asarray(images, dtype=object).reshape(-1))
    if not items or not all(isinstance(b, (bytes, bytearray)) and b for b in items):
        raise ClientError(f"images for {task!r} must be one or more JPEG or PNG files' bytes (non-empty bytes each)")
    out = np.empty((len(items), 1), dtype=object)
    out[:, 0] = [bytes(b) for b in items]
    return out
