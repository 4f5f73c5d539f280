"""How far a served answer is from its reference's: arrays by their largest difference relative to
the reference's largest magnitude, a detector's detections by their best boxes."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from blockflow.clients.detections import Detections

# The ten best detections of each image are each matched in the reference (same label, boxes
# overlapping this much, scores this close).
BEST, IOU, SCORE = 10, 0.9, 0.02
# The scale of an all-zero reference: any difference from it is then far beyond every bound.
TINY = 1e-30


def relative_error(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> float:
    """The largest ``|got - want|`` relative to ``want``'s largest magnitude (at least ``TINY``);
    0.0 for empty arrays, inf where the shapes differ (broadcasting would hide a wrong batch)."""
    if got.shape != want.shape:
        return float("inf")
    if not want.size:
        return 0.0
    # In float64: no wrap-around for integer arrays, no rounding of the difference of float32 ones.
    diff = float(np.abs(np.subtract(got, want, dtype=np.float64)).max())
    return diff / max(float(np.abs(want).max()), TINY)


def iou(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    """Intersection over union of two ``x1, y1, x2, y2`` boxes."""
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, float(x2 - x1)) * max(0.0, float(y2 - y1))
    union = float((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1])) - inter
    return inter / union if union > 0 else 0.0


def detections_agree(got: list[Detections], want: list[Detections]) -> dict[str, float]:
    """How far a detector's answers are from its reference's: the mean reference count, the largest
    count difference, and the share of each image's ``BEST`` best detections that the reference has
    too (the same label, IoU >= ``IOU``, a score within ``SCORE``)."""
    matched = checked = 0
    for g, w in zip(got, want, strict=True):
        for k in range(min(BEST, len(g))):
            checked += 1
            matched += any(w.labels[j] == g.labels[k] and iou(g.boxes[k], w.boxes[j]) >= IOU
                           and abs(float(w.scores[j]) - float(g.scores[k])) <= SCORE for j in range(len(w)))
    diffs = [abs(len(g) - len(w)) for g, w in zip(got, want, strict=True)]
    return {"count": float(np.mean([len(w) for w in want])) if want else 0.0, "count_diff": float(max(diffs, default=0)),
            "best_matched": matched / checked if checked else 1.0}
