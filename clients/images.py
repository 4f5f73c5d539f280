"""Images in, class names out: what a task client needs around the tensors (no torch needed).

Inputs are prepared the way torchvision's ImageNet models were trained: RGB, resized (bilinear,
antialiased), scaled to [0, 1] and normalised with ImageNet's mean and standard deviation; for a
task that takes uint8 images, RGB and resized only (the task normalises them on its GPU); for a task
that takes encoded images, the files' bytes as they are (the task decodes and resizes them), one
file per row of a uint8 ``[batch, L]`` array, zero-padded to the longest (:func:`padded_files`).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from blockflow.core.errors import ClientError

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _rgb(path: Path, height: int, width: int) -> npt.NDArray[np.uint8]:
    """The image at ``path``, RGB, resized to ``(height, width, 3)`` uint8."""
    if not path.is_file():
        raise ClientError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:
            # PIL's bilinear resize antialiases when it shrinks, as torchvision's resize(antialias=True) does.
            return np.asarray(im.convert("RGB").resize((width, height), Image.Resampling.BILINEAR), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as exc:
        raise ClientError(f"cannot decode image {path}: {exc}") from exc


def load_image(path: Path, height: int, width: int) -> npt.NDArray[np.float32]:
    """The image at ``path`` as one float32 ``(3, height, width)`` input, ImageNet-normalised."""
    x = (_rgb(path, height, width).astype(np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def load_image_uint8(path: Path, height: int, width: int, layout: Literal["CHW", "HWC"] = "CHW") -> npt.NDArray[np.uint8]:
    """The image at ``path`` as one uint8 input, ``(3, height, width)`` or ``(height, width, 3)``, not
    normalised: for a task that takes uint8 images (its first block normalises them on its device)."""
    rgb = _rgb(path, height, width)
    return rgb if layout == "HWC" else np.ascontiguousarray(rgb.transpose(2, 0, 1))


def padded_files(files: Sequence[bytes | bytearray]) -> npt.NDArray[np.uint8]:
    """``files`` (each a JPEG or PNG file's bytes) as one batch for a task that takes encoded images: a
    uint8 ``[batch, L]`` array, one file per row, zero-padded to the longest file ``L`` (the task cuts
    each row at its file's end and ignores what follows)."""
    if not files:
        raise ClientError("no image files given")
    out = np.zeros((len(files), max(len(f) for f in files)), dtype=np.uint8)
    for row, data in zip(out, files, strict=True):
        row[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def image_files(paths: Iterable[str | Path]) -> npt.NDArray[np.uint8]:
    """The files at ``paths`` (JPEG or PNG), their bytes as they are, as one batch for a task that takes
    encoded images: uint8 ``[batch, L]``, zero-padded to the longest (:func:`padded_files`)."""
    data = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ClientError(f"image file not found: {path}")
        data.append(path.read_bytes())
    return padded_files(data)


def random_jpegs(n: int, height: int = 224, width: int = 224, seed: int = 0) -> npt.NDArray[np.uint8]:
    """``n`` seeded random RGB images encoded as JPEG (quality 90), as a batch for an encoded task
    (:func:`padded_files`)."""
    rng = np.random.default_rng(seed)
    files = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        files.append(buf.getvalue())
    return padded_files(files)


def class_names(n: int) -> list[str]:
    """ImageNet's class names for a 1000-class output; no names for any other size."""
    if n != 1000:
        return []
    text = (resources.files("blockflow.clients") / "imagenet_classes.txt").read_text()
    return [line for line in text.splitlines() if line and not line.startswith("#")]
