"""blockflow.bench.agreement: how far a served answer is from its reference's."""

from __future__ import annotations

import numpy as np
import pytest

from blockflow.bench.agreement import detections_agree, relative_error
from blockflow.clients.detections import Detections
from blockflow.core.errors import ClientError


def test_the_relative_error_is_the_largest_difference_over_the_reference_scale() -> None:
    want = np.array([[1.0, -4.0], [2.0, 0.0]], np.float32)
    assert relative_error(want.copy(), want) == 0.0
    got = want.copy()
    got[0, 1] = -2.0  # 2 off where the reference's largest magnitude is 4 (a negative value)
    assert relative_error(got, want) == 0.5
    assert relative_error(want, got) == 1.0  # the scale is the second argument's, the reference's


def test_a_zero_reference_another_shape_or_an_empty_answer() -> None:
    zero = np.zeros((2, 3), np.float32)
    assert relative_error(zero, zero) == 0.0
    assert relative_error(zero + 1e-3, zero) > 1e20  # no division by zero, no nan: far beyond any bound
    assert relative_error(np.zeros((1, 3), np.float32), zero) == float("inf")  # not broadcast
    assert relative_error(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)) == 0.0
    # Integers are compared in float64: 0 - 255 does not wrap around to 1 in uint8.
    assert relative_error(np.array([0], np.uint8), np.array([255], np.uint8)) == 1.0


def _dets(boxes: list[list[float]], scores: list[float], labels: list[int]) -> Detections:
    return Detections(np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32), np.array(labels, np.int64))


def test_the_same_detections_agree_and_a_moved_box_or_another_label_does_not() -> None:
    want = [_dets([[0, 0, 10, 10], [20, 20, 40, 40]], [0.9, 0.5], [1, 2])]
    assert detections_agree(want, want) == {"count": 2.0, "count_diff": 0.0, "best_matched": 1.0}
    moved = [_dets([[0, 0, 10, 10], [25, 25, 45, 45]], [0.9, 0.5], [1, 2])]
    assert detections_agree(moved, want)["best_matched"] == 0.5
    relabelled = [_dets([[0, 0, 10, 10]], [0.9], [3])]
    assert detections_agree(relabelled, want) == {"count": 2.0, "count_diff": 1.0, "best_matched": 0.0}


def test_no_images_agree_with_no_images() -> None:
    assert detections_agree([], []) == {"count": 0.0, "count_diff": 0.0, "best_matched": 1.0}


def test_detections_rescale_to_the_original_images_pixels() -> None:
    d = _dets([[10, 20, 30, 40]], [0.9], [3])
    r = d.rescaled((320, 320), (480, 640))  # an image 640 wide, 480 high, resized to 320x320
    np.testing.assert_allclose(r.boxes, [[20, 30, 60, 60]])
    assert r.scores is d.scores and r.labels is d.labels
    with pytest.raises(ClientError, match="positive"):
        d.rescaled((0, 320), (480, 640))
