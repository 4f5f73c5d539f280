"""A chain's link whose batch fails, wherever it fails, fails each sample it was handed once: the tail
answers each its failure, so the head that waits for them fails its requests at once instead of after
the lease, and a middle link hands each on as failed, so the join fails it at once instead of after its
wait (the served chains: tests/integration/test_any_model.py; on the GPU: tests/gpu/test_chain_gpu.py).

The link's thread runs as it does in a stub, with real sockets between it and a head (answers) or the
next link (hand-overs) in a runtime directory; what feeds it (its hand-overs, its claimed slots, its network) stands in."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from blockflow.backend.gpu_waits import GpuWaits
from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.answers import AnswerIn, AnswerOut
from blockflow.backend.tensormq.handout import HandOut
from blockflow.backend.tensormq.handover import HandIn
from blockflow.backend.tensormq.wire import HANDED, ORIGIN, HandOverMessage
from blockflow.backend.trace import NoTracer
from blockflow.core.runtime_dir import read_key
from blockflow.core.spec import HandOver

from ..stub_stand_in import with_pb_utils

_USE = tk.LAYOUT["producer"].start  # a byte of the ticket's slot use: tickets that differ there are two uses


def _ticket(use: int) -> bytes:
    t = bytearray(tk.TICKET_BYTES)
    t[_USE] = use
    return bytes(t)


class _Into:
    """The link's hand-overs: one batch, then nothing."""

    model = "tail"
    wait_s = 5.0

    def __init__(self, got: list[HandOverMessage]) -> None:
        self.got: list[HandOverMessage] | None = got

    def take_any(self, timeout_s: float, most: int, stale_s: float) -> list[HandOverMessage]:
        got, self.got = self.got, None
        if got is None:
            time.sleep(min(timeout_s, 0.01))
            return []
        return got

    def remove_file(self) -> None:
        pass


class _Ends:
    """What the link's thread uses of a block's TensorMQ ends."""

    def __init__(self, into: _Into, answer_out: AnswerOut | None, consumer: Any, fail_begin: bool) -> None:
        self.relay: Any = SimpleNamespace(into=into, out=None)
        self.answer_out, self.consumer, self.fail_begin = answer_out, consumer, fail_begin
        self.tracer, self.stream = NoTracer(), 0
        self.ended: list[bool] = []  # each batch's ``failed``

    def begin(self) -> None:
        if self.fail_begin:
            raise RuntimeError("the call's ends could not start")

    def end_sends(self) -> None:
        pass

    def end(self, releases: list[Any], synced: bool, failed: bool) -> None:
        self.ended.append(failed)


class _Consumer:
    """Claims each use's slot, except the uses it is told are gone."""

    def __init__(self, gone: frozenset[int]) -> None:
        self.gone = gone

    def gather_tensors(self, rows: Any, shapes: Any, stream: int) -> tuple[list[torch.Tensor], list[Any]]:
        if int(rows[0][_USE]) in self.gone:
            raise RuntimeError("its slot was reused")
        return [torch.full((len(rows), 2), float(rows[0][_USE]))], []


class _Runner:
    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def run_all(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.fails:
            raise RuntimeError("the network failed")
        return [xs[0].sum(dim=1)]

    def join(self, columns: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.cat(c) for c in columns]


def _answers(monkeypatch: pytest.MonkeyPatch, runtime: Path, *, gone: frozenset[int] = frozenset(),
             runner_fails: bool = False, begin_fails: bool = False) -> tuple[dict[bytes, list[bytes]], list[bool]]:
    """Hand a tail four samples (two of use 1, one of use 2, one failed before it) for one head; each key's
    answers (status and bytes) as the head reads them, and each batch's ``failed``."""
    head = AnswerIn(runtime, pid=os.getpid() * 4 + 1)
    got: list[HandOverMessage] = [(bytes([k]) * 16, HANDED, _ticket(use), head.origin) for k, use in ((1, 1), (2, 1), (3, 2))]
    got.append((bytes([4]) * 16, b"failed upstream", b"", head.origin))
    out = AnswerOut(runtime)
    ends = _Ends(_Into(got), out, _Consumer(gone), begin_fails)
    errors: list[str] = []
    with with_pb_utils(monkeypatch, "blockflow.backend.link_loop") as link_loop:
        loop = link_loop.LinkLoop(ends, _Runner(runner_fails), ((2,),), torch.device("cpu"), 8, lambda n: None,
                                  errors.append, GpuWaits(torch.device("cpu"), 0))
        answers: dict[bytes, list[bytes]] = {}

        def read() -> None:
            for key, status, answer in head.read():
                answers.setdefault(key, []).append(status if status != HANDED else answer)

        try:
            deadline = time.monotonic() + 5
            while sum(map(len, answers.values())) < len(got) and time.monotonic() < deadline:
                head.wait(0.1)
                read()
        finally:
            loop.close()  # its thread has stopped: whatever it sent waits on the head's socket
        read()  # a second answer would be here
        out.close()
        head.close()
    assert (begin_fails or runner_fails) == bool(errors)
    return answers, ends.ended


def test_a_tail_answers_each_sample_of_a_batch_it_ran(monkeypatch: pytest.MonkeyPatch, runtime: Path) -> None:
    answers, ended = _answers(monkeypatch, runtime)
    assert [len(a) for a in answers.values()] == [1, 1, 1, 1]
    values = {k[0]: torch.frombuffer(bytearray(a[0]), dtype=torch.float32).item() for k, a in answers.items() if k[0] != 4}
    assert values == {1: 2.0, 2: 2.0, 3: 4.0}  # each sample's row summed: its use's number, twice
    assert answers[bytes([4]) * 16] == [b"failed upstream"]
    assert ended == [False]


@pytest.mark.parametrize("where", ["begin", "network"])
def test_a_tail_whose_batch_fails_answers_each_sample_its_failure_once(monkeypatch: pytest.MonkeyPatch, runtime: Path,
                                                                     where: str) -> None:
    answers, ended = _answers(monkeypatch, runtime, begin_fails=where == "begin", runner_fails=where == "network")
    assert sorted(k[0] for k in answers) == [1, 2, 3, 4]
    for key, got in answers.items():
        assert len(got) == 1, f"sample {key[0]} answered {len(got)} times"
        reason = got[0].decode()
        if key[0] == 4:
            assert reason == "failed upstream"
        else:
            assert "block 'tail' failed" in reason and ("could not start" in reason or "network failed" in reason)
    assert ended == [True]


def test_a_tail_fails_the_samples_of_a_slot_it_cannot_claim_and_answers_the_rest(monkeypatch: pytest.MonkeyPatch,
                                                                                runtime: Path) -> None:
    answers, ended = _answers(monkeypatch, runtime, gone=frozenset({1}))
    assert [len(a) for a in answers.values()] == [1, 1, 1, 1]
    assert all(b"slot was reused" in answers[bytes([k]) * 16][0] for k in (1, 2))
    assert torch.frombuffer(bytearray(answers[bytes([3]) * 16][0]), dtype=torch.float32).item() == 4.0
    assert ended == [False]


def test_a_middle_link_whose_batch_fails_before_its_claims_hands_each_sample_on_as_failed(
        monkeypatch: pytest.MonkeyPatch, runtime: Path) -> None:
    origin = ORIGIN.pack(4242)
    got: list[HandOverMessage] = [(bytes([k]) * 16, HANDED, _ticket(1), origin) for k in (1, 2)]
    got.append((bytes([3]) * 16, b"failed upstream", b"", origin))
    nxt = HandIn(runtime, "next", HandOver(takes_from="mid", keys_from=("b0",), link=True), read_key(runtime), 1.0, 10.0,
                 pid=os.getpid() * 4 + 2)
    out = HandOut(runtime, "next", one=True)
    into = _Into(got)
    into.model = "mid"
    ends = _Ends(into, None, _Consumer(frozenset()), fail_begin=True)
    ends.relay.out = out
    with with_pb_utils(monkeypatch, "blockflow.backend.link_loop") as link_loop:
        loop = link_loop.LinkLoop(ends, _Runner(False), ((2,),), torch.device("cpu"), 8, lambda n: None,
                                  lambda line: None, GpuWaits(torch.device("cpu"), 0))
        handed: list[HandOverMessage] = []
        try:
            deadline = time.monotonic() + 5
            while len(handed) < len(got) and time.monotonic() < deadline:
                handed.extend(nxt.take_any(0.05, 32, stale_s=5.0))
        finally:
            loop.close()
        handed.extend(nxt.take_any(0.05, 32, stale_s=5.0))  # what it sent before it stopped (the next link serves a key once)
        out.close()
        nxt.close()
    assert sorted((k[0], o) for k, _, _, o in handed) == [(1, origin), (2, origin), (3, origin)]
    reasons = {k[0]: status.decode() for k, status, _, _ in handed}
    assert reasons[3] == "failed upstream"
    assert all("block 'mid' failed" in reasons[k] and "could not start" in reasons[k] for k in (1, 2)), reasons
    assert ends.ended == [True]
