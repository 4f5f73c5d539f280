"""backend/read_later.py: what a call answered early reads after its answer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from blockflow.backend.read_later import ReadLater
from blockflow.core.errors import RequestError


class HostTensor:
    """What the block uses of a pb_utils.Tensor in host memory: its DLPack export."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to_dlpack(self) -> Any:
        return to_dlpack(self.t)


def test_stand_ins_have_the_images_shape_and_are_read_in_place_after_the_answer() -> None:
    image, other = torch.rand(2, 3, 4, 4), torch.ones(2, 5)
    later = ReadLater()
    stand_in = later.image(0, HostTensor(image), (2, 3, 4, 4))
    assert stand_in.shape == (2, 3, 4, 4) and stand_in.device.type == "meta" and not stand_in.is_cuda
    with pytest.raises((NotImplementedError, RuntimeError)):
        stand_in.cpu()  # used before it is read: fails loudly, never reads nothing
    laps: list[str] = []
    xs = later.read([stand_in, other], 0, laps.append)
    assert torch.equal(xs[0], image) and xs[0].data_ptr() == image.data_ptr() and xs[1] is other  # zero-copy
    assert laps == ["run:image"]  # no slot waits listed: no "run:wait"


def test_an_image_that_is_not_what_its_stand_in_said_fails_the_call() -> None:
    later = ReadLater()
    stand_in = later.image(0, HostTensor(torch.zeros(1, 3, 4, 4, dtype=torch.float16)), (1, 3, 4, 4))
    with pytest.raises(RequestError, match="float16"):
        later.read([stand_in], 0)


def test_nothing_left_reads_nothing() -> None:
    xs = [torch.zeros(1)]
    assert ReadLater().read(xs, 0) == xs
