"""Images in, class names out: what a task client needs around the tensors.

Inputs are prepared the way torchvision's ImageNet models were trained: RGB, resized, scaled to
[0, 1] and normalised with ImageNet's mean and standard deviation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms.v2 import functional as F

from blockflow.core.errors import ClientError

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def load_image(path: Path, height: int, width: int) -> npt.NDArray[np.float32]:
    """The image at ``path`` as one float32 ``(3, height, width)`` input, ImageNet-normalised."""
    if not path.is_file():
        raise ClientError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as exc:
        raise ClientError(f"cannot decode image {path}: {exc}") from exc
    img = torch.from_numpy(rgb.copy()).permute(2, 0, 1)
    img = F.resize(img, [height, width], antialias=True)
    x = F.normalize(img.to(torch.float32) / 255.0, IMAGENET_MEAN, IMAGENET_STD)
    return np.ascontiguousarray(x.numpy(), dtype=np.float32)


def class_names(n: int) -> list[str]:
    """ImageNet's class names for a 1000-class output; no names for any other size."""
    if n != 1000:
        return []
    from torchvision.models import ResNet50_Weights  # the weights' metadata only: nothing is downloaded

    return list(ResNet50_Weights.IMAGENET1K_V2.meta["categories"])
