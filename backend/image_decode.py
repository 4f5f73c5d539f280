"""JPEG and PNG files' bytes (a task whose plan says ``input: {dtype: encoded}``) decoded into the
uint8 ``[B, 3, H, W]`` batch the first block's runner takes, as it takes uint8 CHW images.

On a GPU, a call's JPEGs go through one batched nvJPEG decode (``torchvision.io.decode_jpeg`` with a
CUDA device); PNGs (by Pillow), CMYK JPEGs and JPEGs the GPU decode refuses (progressive oddities,
a build without nvJPEG) are decoded on the CPU and copied over. On a CPU block everything decodes on the CPU.
Each file arrives as one row of a request's uint8 ``[n, L]`` input, zero-padded to the request's longest
file. Each is cut at its end first (a JPEG's last end-of-image marker, after its last scan; a PNG's
IEND chunk): whatever follows is padding, ignored, whatever its bytes. A row whose file's end is not
found is a truncated file. Then each is checked (its format, its size, its pixel count from its
header), so that an image the client got wrong fails its own request alone, with a clear message.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as nnf
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from blockflow.core.errors import RequestError

# Limits on one untrusted image, checked before it is decoded: 32 MiB of bytes is far above any
# photo a classifier is sent (a 24-megapixel camera JPEG is ~10 MiB) and 40 megapixels (120 MB
# decoded) above any camera's frame, while a "decompression bomb" (a small file that claims a huge
# image) is refused from its header before it can take the block's host or GPU memory.
MAX_BYTES = 32 << 20
MAX_PIXELS = 40_000_000

_JPEG, _PNG = b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"
_SOS, _EOI = b"\xff\xda", b"\xff\xd9"
_IEND = b"\0\0\0\0IEND"


def file_of(row: bytes, k: int) -> bytes:
    """Image ``k``'s file in ``row`` (its bytes, then any padding): a JPEG up to and including its last
    end-of-image marker, a PNG up to the end of its IEND chunk; a row that is neither is returned as it
    is (refused by its format check). A :class:`RequestError` where the file's end is not found."""
    what = f"image {k} of the request"
    if row.startswith(_JPEG):
        # Entropy-coded data never holds FF DA or FF D9 (a data FF is followed by 00 or a restart
        # marker), so a JPEG whose last scan has no end marker after it was cut short; refused here
        # rather than handed to nvJPEG, whose handling of truncated data is not documented.
        end = row.rfind(_EOI)
        if end < row.rfind(_SOS):
            raise RequestError(f"{what} is a truncated JPEG (no end-of-image marker after its last scan)")
        return row[:end + len(_EOI)] if end >= 0 else row  # no scan and no end: its header check refuses it
    if row.startswith(_PNG):
        # IEND is an empty chunk (length 0, type, CRC): the last one in the row ends the file. Its
        # bytes occurring by chance in compressed data before it would not matter: the last one counts.
        end = row.rfind(_IEND)
        if end < len(_PNG) or end + len(_IEND) + 4 > len(row):
            raise RequestError(f"{what} is a truncated PNG (no IEND chunk at its end)")
        return row[:end + len(_IEND) + 4]
    return row


def _checked(row: bytes, k: int) -> tuple[torch.Tensor, bool]:
    """Image ``k``'s file (in ``row``, cut at its end) as the uint8 tensor torchvision decodes, and whether
    nvJPEG may decode it; a :class:`RequestError` naming the problem where it is no JPEG or PNG, too
    large, or truncated."""
    what = f"image {k} of the request"
    data = file_of(row, k)
    if len(data) > MAX_BYTES:
        raise RequestError(f"{what} has {len(data)} bytes, over the limit of {MAX_BYTES} bytes per image")
    if not data.startswith((_JPEG, _PNG)):
        raise RequestError(f"{what} is neither a JPEG nor a PNG file (this task takes JPEG or PNG files' bytes)")
    try:  # reads the header only: the size is known before any pixel is decoded
        with Image.open(io.BytesIO(data), formats=("JPEG", "PNG")) as im:
            (w, h), mode = im.size, im.mode
    except Exception as exc:  # Pillow's errors for a broken header vary (OSError, SyntaxError, struct.error, ...)
        raise RequestError(f"{what} has an unreadable header ({type(exc).__name__}: {exc})") from exc
    if w * h > MAX_PIXELS:
        raise RequestError(f"{what} has {w}x{h} pixels, over the limit of {MAX_PIXELS} pixels per image")
    jpeg = data.startswith(_JPEG)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), jpeg and mode != "CMYK"


def _cpu(data: torch.Tensor) -> torch.Tensor:
    """One file decoded on the CPU to uint8 RGB ``[3, h, w]`` (a 16-bit PNG scaled to 8 bits: its high bytes)."""
    raw = data.numpy().tobytes()
    if raw.startswith(_PNG):
        # Pillow, not torchvision: torchvision 0.29's decode_png took the process down (SIGSEGV) on a PNG
        # whose chunks are whole but whose compressed pixels are not (libpng's error, unhandled), where
        # Pillow raises. Same pixels as torchvision's for 8- and 16-bit, grey, palette and alpha PNGs.
        with Image.open(io.BytesIO(raw), formats=("PNG",)) as im:
            im.load()
            if im.mode.startswith("I"):  # 16-bit grey
                grey = (np.asarray(im).astype(np.int32) >> 8).astype(np.uint8)
                return torch.from_numpy(np.ascontiguousarray(grey)).expand(3, *grey.shape).contiguous()
            return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()
    x: torch.Tensor = decode_image(data, mode=ImageReadMode.RGB)
    return x if x.dtype == torch.uint8 else (x.to(torch.int32) >> 8).to(torch.uint8)


class ImageDecoder:
    """Decodes a call's encoded images to the network's ``[3, H, W]`` on ``device``."""

    def __init__(self, chw: Sequence[int], device: torch.device) -> None:
        self.size = (int(chw[1]), int(chw[2]))
        self.device = device
        self.gpu = device.type == "cuda"

    def decode(self, requests: Sequence[Sequence[bytes]]) -> list[torch.Tensor | RequestError]:
        """Each request's files (each a file's bytes, padded or not: :func:`file_of`) as one uint8
        ``[n, 3, H, W]`` tensor on the device, or the :class:`RequestError` that fails it (its first bad image's)."""
        files: list[list[torch.Tensor] | RequestError] = []
        nvjpeg: list[tuple[int, int]] = []  # (request, image) of the files for the batched GPU decode
        for r, images in enumerate(requests):
            try:
                if not images:
                    raise RequestError("the request has no image")
                checked = [_checked(data, k) for k, data in enumerate(images)]
            except RequestError as exc:
                files.append(exc)
                continue
            files.append([t for t, _ in checked])
            nvjpeg += [(r, k) for k, (_, jpeg) in enumerate(checked) if jpeg and self.gpu]
        decoded: dict[tuple[int, int], torch.Tensor] = {}
        if nvjpeg:
            try:
                batch = [files[r][k] for r, k in nvjpeg]  # type: ignore[index]  # the requests of nvjpeg were readable
                decoded.update(zip(nvjpeg, decode_jpeg(batch, mode=ImageReadMode.RGB, device=self.device), strict=True))
            except Exception:  # a file nvJPEG refuses fails its whole batch: each is decoded on the CPU below
                decoded.clear()
        out: list[torch.Tensor | RequestError] = []
        for r, given in enumerate(files):
            try:
                if isinstance(given, RequestError):
                    raise given
                out.append(torch.stack([self._fit(decoded.get((r, k)), data, k) for k, data in enumerate(given)]))
            except RequestError as exc:
                out.append(exc)
        return out

    def _fit(self, x: torch.Tensor | None, data: torch.Tensor, k: int) -> torch.Tensor:
        """Image ``k`` as nvJPEG decoded it (``x``), else decoded on the CPU; on the device, at the network's size."""
        if x is None:
            try:
                x = _cpu(data).to(self.device)
            except Exception as exc:  # torchvision's RuntimeError for corrupt data, whatever the decoder
                why = re.sub(r"^[^,]*, \S+:\d+, ", "", str(exc))  # without the C++ function and source line
                raise RequestError(f"image {k} of the request cannot be decoded: {why}") from exc
        if tuple(x.shape[1:]) == self.size:
            return x
        # torch's bilinear, antialiased resize (as torchvision's ImageNet presets resize) computed in
        # float and rounded once, on every device: a CPU block and a GPU block give the same pixels
        # (torchvision's resize of a uint8 tensor on the CPU runs its own uint8 kernel, one level off).
        y = nnf.interpolate(x[None].float(), size=self.size, mode="bilinear", antialias=True, align_corners=False)
        return y[0].round_().clamp_(0, 255).to(torch.uint8)
