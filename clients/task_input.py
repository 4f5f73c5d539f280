"""What a task's ``IMAGE`` input takes (datatype and one image's shape, from its metadata), and the check
that images a client sends are of that kind: refused, never cast, when they are not. A task whose plan
says ``input: {dtype: encoded}`` takes JPEG or PNG files' bytes: Triton UINT8 ``[batch, L]``, one file per
row, zero-padded to the longest (:func:`blockflow.clients.images.padded_files`). A task whose network takes
more than the image takes its side inputs too (:class:`SideInputKind`), each named by the network's argument,
batched like the image; they are checked against the task's metadata before a call, and refused, never
cast, when they are not what it takes."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import numpy as np

from blockflow.clients.images import padded_files
from blockflow.core.errors import ClientError
from blockflow.core.spec import IMAGE

# Triton's datatypes of side inputs, and the numpy dtypes a client sends them in.
SIDE_DTYPES: dict[str, np.dtype[Any]] = {"FP32": np.dtype(np.float32), "INT64": np.dtype(np.int64)}


@dataclass(frozen=True)
class SideInputKind:
    """A task input other than the image: its Triton name, Triton datatype (``FP32`` or ``INT64``) and
    one sample's shape (the batch comes first, the image's)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype it is sent in (float32 or int64)."""
        return SIDE_DTYPES.get(self.datatype, np.dtype(np.float32))

    def __str__(self) -> str:
        return f"{self.name} ({self.dtype} [batch, {', '.join(map(str, self.shape))}])"


@dataclass(frozen=True)
class TaskInput:
    """What a task's ``IMAGE`` takes: Triton's datatype (``FP32`` or ``UINT8``) and one image's shape:
    ``[3, H, W]`` or ``[H, W, 3]`` for pixels, ``(-1,)`` for encoded files (``UINT8``, one file's bytes
    per row, of any length); and the names of the outputs the task answers with (``LOGITS``, or a
    detector's ``COUNT``, ``BOXES``, ...; empty: not known); and its side inputs, in the task's order."""

    datatype: str = "FP32"
    shape: tuple[int, ...] | None = None  # None: not known (a model without an IMAGE input)
    outputs: tuple[str, ...] = ()
    side_inputs: tuple[SideInputKind, ...] = ()

    @property
    def layout(self) -> Literal["CHW", "HWC"]:
        return "HWC" if self.shape is not None and len(self.shape) == 3 and self.shape[0] != 3 and self.shape[-1] == 3 else "CHW"

    @property
    def uint8(self) -> bool:
        """uint8 pixels (not files)."""
        return self.datatype == "UINT8" and not self.encoded

    @property
    def encoded(self) -> bool:
        """JPEG or PNG files' bytes: uint8 rows of any length."""
        return self.datatype == "UINT8" and self.shape == (-1,)

    @staticmethod
    def of(meta: Any) -> TaskInput:
        """From a model's metadata (HTTP: a dict, gRPC: a message)."""
        inputs = meta["inputs"] if isinstance(meta, dict) else [
            {"name": i.name, "datatype": i.datatype, "shape": list(i.shape)} for i in meta.inputs]
        outputs = tuple(str(o["name"]) for o in meta.get("outputs", ())) if isinstance(meta, dict) else tuple(
            o.name for o in meta.outputs)
        for i in inputs:
            if i["name"] == IMAGE:
                shape = tuple(int(d) for d in i["shape"])
                # [batch, L]: encoded files (a network's image has three axes); a batching model's
                # every input has the batch first (its side inputs too).
                batched = len(shape) in (2, 4)
                sides = tuple(SideInputKind(str(j["name"]), str(j["datatype"]),
                                            tuple(int(d) for d in j["shape"])[1 if batched else 0:])
                              for j in inputs if _side(str(j["name"])))
                return TaskInput(str(i["datatype"]), shape[-1:] if len(shape) <= 2 else shape[-3:], outputs, sides)
        return TaskInput(outputs=outputs)

    def check_sides(self, task: str, inputs: Mapping[str, Any] | None, batch: int) -> dict[str, Any]:
        """``inputs`` as the task takes them, in its order: each of its side inputs given, none other, each
        a numpy array (or a CPU torch tensor) of its dtype and shape ``[batch, ...]`` (``batch``: the
        images'). Python numbers and lists are taken where they convert exactly (floats for an fp32 input:
        to the nearest float32, the only way Python writes one)."""
        given = dict(inputs or {})
        takes = ", ".join(map(str, self.side_inputs)) or "none"
        unknown = [n for n in given if n not in {s.name for s in self.side_inputs}]
        if unknown:
            raise ClientError(f"task {task!r} takes no input {unknown[0]!r}: its inputs besides {IMAGE} are {takes}")
        missing = [s for s in self.side_inputs if s.name not in given]
        if missing:
            raise ClientError(f"task {task!r} needs its side input(s) {', '.join(map(str, missing))}: pass "
                              f"inputs={{{', '.join(f'{s.name!r}: array' for s in missing)}}}")
        return {s.name: _side_array(task, s, given[s.name], batch) for s in self.side_inputs}

    @staticmethod
    def given(task: str, images: Any) -> tuple[TaskInput, Any]:
        """For a task whose metadata could not be read: the input ``images`` make as they are (files'
        bytes, or uint8 ``[batch, L]`` rows, as files; uint8 pixels as uint8; other numbers as float32)
        and the images so, so that the call reaches the server, which says why it fails (not served,
        loading), rather than a check against a kind the task may not have."""
        def files(items: Any) -> bool:
            return isinstance(items, (list, tuple)) and bool(items) and all(isinstance(b, (bytes, bytearray)) for b in items)

        if isinstance(images, (bytes, bytearray)) or files(images):
            return TaskInput("UINT8", (-1,)), _files(task, images)
        if isinstance(images, (list, tuple)):
            images = _stacked(task, images)  # one batch, said as for a task whose metadata was read
        try:
            if getattr(images, "dtype", None) is None:  # a scalar, say
                images = np.asarray(images)
            if getattr(images, "dtype", None) == np.object_:
                if files(items := list(images.ravel())):
                    return TaskInput("UINT8", (-1,)), _files(task, items)
                raise ValueError("an array of objects")
            if 0 in tuple(getattr(images, "shape", ())) or getattr(images, "ndim", 0) == 0:
                raise ValueError(f"no image in it (shape {list(getattr(images, 'shape', ()))})")
            if _rows(images):
                return TaskInput("UINT8", (-1,)), _contiguous(images)
            u8 = _uint8(images)
            return TaskInput("UINT8" if u8 else "FP32"), _contiguous(images, u8)
        except (TypeError, ValueError) as exc:
            raise ClientError(f"images for {task!r} must be an array of numbers (numpy or torch) or files' bytes: {exc}") from None

    def check(self, task: str, images: Any) -> Any:
        """``images`` as the task takes them (contiguous; numpy stays numpy, torch stays torch). A float
        array for a uint8 task (or uint8 for a float one) is refused, never cast: the values would be
        scaled wrongly, not merely rounded. For an encoded task: the files as a uint8 ``[batch, L]`` array,
        zero-padded to the longest (given as bytes, a sequence of bytes, or such an array); arrays of
        pixels are refused."""
        listed = isinstance(images, (list, tuple))
        if self.encoded:
            if listed or isinstance(images, (bytes, bytearray)):
                return _files(task, images)
            if not _rows(images):
                self._refuse_pixels(task, images)
            if 0 in images.shape:
                raise ClientError(f"images for {task!r} must be one or more JPEG or PNG files' bytes, got shape {list(images.shape)}")
            return _contiguous(images)
        if isinstance(images, (bytes, bytearray)) or getattr(images, "dtype", None) == np.object_ or _rows(images) or (
                listed and any(isinstance(b, (bytes, bytearray)) for b in images)):
            raise ClientError(f"task {task!r} takes {'uint8' if self.uint8 else 'float32'} image arrays, not encoded files' "
                              "bytes: decode them first (blockflow.clients.images.load_image"
                              f"{'_uint8' if self.uint8 else ''}), or serve the model with input: {{dtype: encoded}}")
        if listed:
            images = _stacked(task, images)
        if getattr(images, "shape", None) is None or getattr(images, "dtype", None) is None:
            raise ClientError(f"images for {task!r} must be an array (numpy or torch) or a list of them, "
                              f"got {type(images).__name__}")
        shape = list(images.shape)
        want = f"[batch, {', '.join(map(str, self.shape))}]" if self.shape else "[batch, 3, H, W]"
        if len(shape) != 4 or (tuple(shape[1:]) != self.shape if self.shape else shape[1] != 3) or shape[0] == 0:
            raise ClientError(f"images for {task!r} must be {want} with a batch of one or more; got shape {shape}")
        is_u8 = _uint8(images)
        if self.uint8 != is_u8:
            got = str(images.dtype).removeprefix("torch.")
            raise ClientError(f"task {task!r} takes {'uint8' if self.uint8 else 'float32'} images {want}, got {got}: "
                              + ("send the image's uint8 values (blockflow.clients.images.load_image_uint8), "
                                 "not normalised floats; the task normalises them on the GPU" if self.uint8 else
                                 "send float32 images normalised as the model expects (blockflow.clients.images.load_image)"))
        return _contiguous(images, self.uint8)

    @staticmethod
    def _refuse_pixels(task: str, images: Any) -> NoReturn:
        got = str(getattr(images, "dtype", type(images).__name__)).removeprefix("torch.")
        shape = list(getattr(images, "shape", ()))
        raise ClientError(f"task {task!r} takes encoded images (JPEG or PNG files' bytes, one per image), got a {got} "
                          f"array of shape {shape}: send the files as they are (blockflow.clients.images.image_files: "
                          "uint8 [batch, L], one file per row, zero-padded to the longest), not decoded pixels")


def _side(name: str) -> bool:
    """Whether an input of a model that takes IMAGE is a side input, not a block's hop tensor (side
    inputs never take the reserved names: ACTIVATION*, HANDED*)."""
    return name != IMAGE and not name.startswith(("ACTIVATION", "HANDED"))


def _side_array(task: str, side: SideInputKind, value: Any, batch: int) -> Any:
    """``value`` as the contiguous numpy array ``side`` takes, or a :class:`ClientError` that names it."""
    want = f"{side.dtype} [batch, {', '.join(map(str, side.shape))}]"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if hasattr(value, "dtype"):  # an array (or a numpy scalar): of the dtype, never cast
        x = np.asarray(value)
        if x.dtype != side.dtype:
            raise ClientError(f"side input {side.name!r} of task {task!r} takes {want}, got {x.dtype}: "
                              f"send it as {side.dtype} (x.astype(np.{side.dtype}) if its values are exact)")
    else:
        x = _exact(task, side, want, value)
    if x.shape != (batch, *side.shape):
        raise ClientError(f"side input {side.name!r} of task {task!r} takes {want} with the images' batch {batch}; "
                          f"got shape {list(x.shape)}" + (" (one row per image)" if x.shape[1:] == side.shape else ""))
    return np.ascontiguousarray(x)


def _exact(task: str, side: SideInputKind, want: str, value: Any) -> Any:
    """Python numbers or (nested) lists as ``side``'s dtype where they convert exactly."""
    try:
        x = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged lists
        raise ClientError(f"side input {side.name!r} of task {task!r} takes {want}, got {type(value).__name__}: {exc}") from None
    kind = x.dtype.kind
    ok = kind in "iu" or (kind == "f" and side.dtype == np.float32)
    if ok:
        with np.errstate(over="ignore", invalid="ignore"):
            y = x.astype(side.dtype)
            # Integers must be kept exactly; floats rounded to float32 must stay finite.
            ok = bool(np.array_equal(y.astype(x.dtype), x) if kind in "iu" else np.array_equal(np.isfinite(y), np.isfinite(x)))
    if not ok:
        raise ClientError(f"side input {side.name!r} of task {task!r} takes {want}; {x.dtype} values "
                          f"{'' if kind in 'iuf' else 'of this kind '}do not convert to {side.dtype} exactly")
    return y


def _rows(images: Any) -> bool:
    """Whether ``images`` is a uint8 ``[batch, L]`` array (numpy or torch): files' bytes, one per row."""
    return getattr(images, "ndim", None) == 2 and _uint8(images)


def _uint8(images: Any) -> bool:
    """Whether ``images`` (numpy or torch) hold uint8 values."""
    return str(images.dtype).removeprefix("torch.") == "uint8"


def _stacked(task: str, images: list[Any] | tuple[Any, ...]) -> Any:
    """A list of images (each ``[3, H, W]`` or ``[H, W, 3]``, numpy or torch, of one shape and dtype) as one batch."""
    if not images:
        raise ClientError(f"images for {task!r}: the list is empty")
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(x, torch.Tensor) for x in images):
        shapes = {tuple(x.shape) for x in images}
        dtypes = {x.dtype for x in images}
        devices = {str(x.device) for x in images}
        if len(devices) > 1:
            raise ClientError(f"images for {task!r}: a list of tensors on one device, got {sorted(devices)}")
        if len(shapes) == 1 and len(dtypes) == 1:
            return torch.stack(list(images))
    elif not any(hasattr(x, "dtype") for x in images):  # nested Python lists of numbers: no dtype to keep per item
        try:
            whole = np.asarray(images)
        except (TypeError, ValueError) as exc:  # ragged
            raise ClientError(f"images for {task!r}: a list of images must hold one shape each: {exc}") from None
        if whole.dtype != np.object_:
            return whole
        shapes, dtypes = {whole.shape}, {str(whole.dtype)}
    else:
        try:
            arrays = [np.asarray(x) for x in images]
        except (TypeError, ValueError, RuntimeError) as exc:  # a CUDA tensor among numpy arrays, say
            raise ClientError(f"images for {task!r}: a list of arrays of one kind, {exc}") from None
        shapes = {a.shape for a in arrays}
        dtypes = {str(a.dtype) for a in arrays}
        if len(shapes) == 1 and len(dtypes) == 1 and arrays[0].dtype != np.object_:
            return np.stack(arrays)
    raise ClientError(f"images for {task!r}: a list of images must hold one shape and dtype each (one image "
                      f"[3, H, W] or [H, W, 3] per item); got shapes {sorted(map(list, shapes))}, dtypes {sorted(map(str, dtypes))}")


def _contiguous(images: Any, uint8: bool = True) -> Any:
    """``images`` (numpy or torch) contiguous, in uint8 or float32."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(images, torch.Tensor):
        return images.detach().to(torch.uint8 if uint8 else torch.float32).contiguous()
    return np.ascontiguousarray(images, dtype=np.uint8 if uint8 else np.float32)


def _files(task: str, images: Any) -> Any:
    """Encoded ``images`` (one file's bytes, or a sequence of them) as the uint8 ``[batch, L]`` array the task takes."""
    items = [images] if isinstance(images, (bytes, bytearray)) else list(images)
    if not items or not all(isinstance(b, (bytes, bytearray)) and b for b in items):
        raise ClientError(f"images for {task!r} must be one or more JPEG or PNG files' bytes (non-empty bytes each)")
    return padded_files(items)
