"""A detector task's answer per image: its outputs (``COUNT``, ``BOXES``, ``SCORES``, ``LABELS``
and, for Mask R-CNN, ``MASKS``; padded along the detection axis to the request's largest count)
cut to each image's own count."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from blockflow.core.errors import ClientError
from blockflow.core.spec import BOXES, COUNT, LABELS, MASKS, SCORES


@dataclass(frozen=True)
class Detections:
    """One image's detections, best first: ``boxes`` ``[n, 4]`` (x1, y1, x2, y2 in the input's
    pixels, or the original image's where the task takes ``ORIGINAL_SIZE``), ``scores`` ``[n]``, ``labels`` ``[n]`` (int64) and, from Mask R-CNN, ``masks``
    ``[n, H, W]`` (probabilities)."""

    boxes: npt.NDArray[np.float32]
    scores: npt.NDArray[np.float32]
    labels: npt.NDArray[np.int64]
    masks: npt.NDArray[np.float32] | None = None

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def rescaled(self, input_hw: tuple[int, int], original_hw: tuple[int, int]) -> Detections:
        """These detections with their boxes in the pixels of the image the input was resized from
        (``original_hw``: its height and width; ``input_hw``: the task's). Masks stay the input's size."""
        (ih, iw), (oh, ow) = input_hw, original_hw
        if min(ih, iw, oh, ow) <= 0:
            raise ClientError(f"sizes must be positive: input {input_hw}, original {original_hw}")
        scale = np.array([ow / iw, oh / ih, ow / iw, oh / ih], dtype=np.float32)
        return Detections(self.boxes * scale, self.scores, self.labels, self.masks)


def is_detector(output_names: list[str]) -> bool:
    """Whether a task with these outputs is a detector's."""
    return COUNT in output_names and BOXES in output_names


def per_image(outputs: Mapping[str, npt.NDArray[Any]]) -> list[Detections]:
    """Each image's :class:`Detections` from a detector task's outputs."""
    missing = [n for n in (COUNT, BOXES, SCORES, LABELS) if n not in outputs]
    if missing:
        raise ClientError(f"not a detector's answer: it lacks {', '.join(missing)}")
    counts = np.asarray(outputs[COUNT]).reshape(-1)
    masks = outputs.get(MASKS)
    out = []
    for i, n in enumerate(int(c) for c in counts):
        out.append(Detections(np.asarray(outputs[BOXES][i, :n], dtype=np.float32),
                              np.asarray(outputs[SCORES][i, :n], dtype=np.float32),
                              np.asarray(outputs[LABELS][i, :n], dtype=np.int64),
                              None if masks is None else np.asarray(masks[i, :n], dtype=np.float32)))
    return out
