"""A task's image as a block that takes it receives it (uint8 or float32, CHW or HWC; an encoded
image once ``blockflow.backend.image_decode`` made it uint8 CHW), turned into what its first stage
takes: float, ``[B, 3, H, W]``, normalised, in the block's dtype and layout.

Runs on the block's device inside what the block runs (captured in its CUDA graphs), so a uint8
image crosses the server and the host-to-device copy as a quarter of the bytes of a float32 one.
"""

from __future__ import annotations

import torch

from blockflow.core.spec import ImageInput, ModelSpec

UINT8_SCALE = 1.0 / 255.0


def feed_dtype(spec: ModelSpec) -> torch.dtype | None:
    """The dtype of the image ``spec``'s runner is fed, where it takes the image (None where it does
    not): uint8 for uint8 images and for encoded ones, once decoded."""
    if not spec.takes_image:
        return None
    return torch.uint8 if spec.image is not None and spec.image.dtype in ("uint8", "encoded") else torch.float32


def takes_encoded(spec: ModelSpec) -> bool:
    """Whether ``spec`` takes the image as JPEG/PNG bytes (decoded in ``execute``, before its runner)."""
    return spec.takes_image and spec.image is not None and spec.image.dtype == "encoded"


def fed_shapes(spec: ModelSpec) -> tuple[tuple[int, ...], ...]:
    """Per-sample shape of every tensor ``spec``'s runner is fed: as they arrive, except an encoded
    image, which arrives as ``[-1]`` (one file's bytes, padded) and is fed decoded, ``input_shape``."""
    return (tuple(spec.input_shape), *spec.extra_in_shapes) if takes_encoded(spec) else spec.in_shapes


class ImageConversion:
    """``image``'s conversion on ``device``: x (* 1/255 for uint8) permuted to CHW, then
    ``(x - mean) / std`` as one multiply-add per element (``x * (scale / std) + (-mean / std)``:
    within fp32 rounding of the two-step form), in ``dtype`` and ``memory_format``."""

    def __init__(self, image: ImageInput, device: torch.device, dtype: torch.dtype,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.hwc = image.layout == "HWC"
        self.dtype, self.memory_format = dtype, memory_format
        scale = UINT8_SCALE if image.dtype in ("uint8", "encoded") else 1.0
        mean = image.mean or (0.0,) * 3
        std = image.std or (1.0,) * 3
        self.scale: torch.Tensor | None = None
        self.shift: torch.Tensor | None = None
        if scale != 1.0 or image.mean:
            # Computed in float64 and rounded once, so each factor is the nearest fp32 to its exact value.
            self.scale = torch.tensor([scale / s for s in std], dtype=torch.float64).view(1, -1, 1, 1).to(device, torch.float32)
            self.shift = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)],
                                      dtype=torch.float64).view(1, -1, 1, 1).to(device, torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, 3, H, W]`` (CHW) or ``[B, H, W, 3]`` (HWC), on the conversion's device."""
        if self.hwc:
            x = x.permute(0, 3, 1, 2)  # a view, already channels-last in memory
        # The layout change (if any) on the input's own bytes: a quarter of the traffic for uint8.
        x = x.contiguous(memory_format=self.memory_format)
        if self.scale is not None and self.shift is not None:
            x = torch.addcmul(self.shift, x, self.scale)  # promotes uint8 to float32
        elif x.dtype != torch.float32:
            x = x.to(torch.float32)
        return x.to(self.dtype).contiguous(memory_format=self.memory_format)
