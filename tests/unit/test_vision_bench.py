"""The vision bench's checks: a detector's answers against its reference's, logits and maps."""

from __future__ import annotations

import numpy as np

from blockflow.bench.vision import detections_agree, logits_agree
from blockflow.clients.detections import Detections


def _dets(boxes: list[list[float]], scores: list[float], labels: list[int]) -> Detections:
    return Detections(np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32), np.array(labels, np.int64))


def test_the_same_detections_agree_and_a_moved_box_or_another_label_does_not() -> None:
    want = [_dets([[0, 0, 10, 10], [20, 20, 40, 40]], [0.9, 0.5], [1, 2])]
    assert detections_agree(want, want) == {"count": 2.0, "count_diff": 0.0, "best_matched": 1.0}
    moved = [_dets([[0, 0, 10, 10], [25, 25, 45, 45]], [0.9, 0.5], [1, 2])]
    assert detections_agree(moved, want)["best_matched"] == 0.5
    relabelled = [_dets([[0, 0, 10, 10]], [0.9], [3])]
    assert detections_agree(relabelled, want) == {"count": 2.0, "count_diff": 1.0, "best_matched": 0.0}


def test_logits_and_maps() -> None:
    want = np.zeros((1, 2, 2, 2), np.float32)
    want[0, 0] = 1.0
    got = want.copy()
    got[0, 1, 0, 0] = 2.0  # one pixel changes class
    e = logits_agree(got, want)
    assert e["rel_err"] == 2.0 and e["pixels_agree"] == 0.75
    assert logits_agree(np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)) == {"rel_err": 0.0}
