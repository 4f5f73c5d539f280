"""A chain that ends its tasks (hand_over: chain, chain_answers: head): its last block is a link, the tail,
and answers the head instance that took each request; which blocks qualify, how the plan is
rendered, and the answers' wire and sockets (the served case is tests/integration/test_any_model.py's
chain_tail plan; on the GPU, tests/gpu/test_chain_gpu.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.dlpack
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.answers import AnswerIn, AnswerOut
from blockflow.backend.tensormq.handout import HandOut, NoReceiverError
from blockflow.backend.tensormq.handover import HandIn
from blockflow.backend.tensormq.wire import (
    DGRAM_MAX,
    HANDED,
    NO_ORIGIN,
    ORIGIN,
    answer_failed,
    answered,
    pack_answers,
    unpack_answers,
)
from blockflow.core.runtime_dir import read_key
from blockflow.core.spec import ANSWER_MAX, HandOver, ModelSpec, TaskOutput
from blockflow.ensemble_gen import generator
from blockflow.plan import direct_pairs, load_plan, parse_plan_text

from ..stub_stand_in import with_pb_utils

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "tests" / "plans" / "chain_tail.yaml"
CHAIN = {"t": ["b0", "b1", "b2", "b3", "b4"]}


def _config(files: dict[str, bytes], model: str) -> mc.ModelConfig:
    return text_format.Parse(files[f"{model}/config.pbtxt"].decode(), mc.ModelConfig())


def _spec(files: dict[str, bytes], model: str) -> ModelSpec:
    return ModelSpec.model_validate(json.loads(_config(files, model).parameters["blockflow.spec"].string_value))


def test_a_chain_whose_last_link_ends_its_tasks_has_no_join_and_its_head_is_answered_by_that_tail() -> None:
    relay = direct_pairs.pairs(CHAIN, chain=True, tails={"b4"})
    assert relay == {"b0": "b1", "b1": "b2", "b2": "b3", "b3": "b4"}
    assert direct_pairs.chain_steps(CHAIN["t"], relay) == ["b0"]
    roles = direct_pairs.chain_roles(CHAIN, relay)
    assert roles["b0"] == HandOver(to="b1", own_keys=True, to_link=True, answered_by="b4")
    assert roles["b3"] == HandOver(to="b4", takes_from="b2", keys_from=("b0",), link=True, to_link=True)
    assert roles["b4"] == HandOver(takes_from="b3", keys_from=("b0",), link=True, tail=True)


@pytest.mark.parametrize("paths", [
    {"t": ["b0", "b1", "b2", "b3"], "u": ["b0", "b1", "b2", "b3", "b4"]},  # b3 goes on in u
    {"t": ["b0", "b1", "b2", "b3"], "u": ["c0", "c1", "c2", "b3"]},  # b3 has two blocks before it
])
def test_a_last_block_that_is_not_last_everywhere_or_joins_two_chains_is_no_tail(paths: dict[str, list[str]]) -> None:
    relay = direct_pairs.pairs(paths, chain=True, tails={"b3"})
    assert relay.get("b2") != "b3"


def test_the_generator_renders_a_chain_that_ends_its_task_as_one_step_that_answers_the_task() -> None:
    files = generator.render(load_plan(PLAN))
    task = _config(files, "task_a")
    assert [s.model_name for s in task.ensemble_scheduling.step] == ["stem"]
    assert dict(task.ensemble_scheduling.step[0].output_map) == {"LOGITS": "LOGITS"}
    stem, tail = _spec(files, "stem"), _spec(files, "tail")
    assert stem.answers_task and not stem.gives_logits and stem.hand_over is not None and stem.hand_over.answered_by == "tail"
    assert [o.name for o in _config(files, "stem").output] == ["LOGITS"] and list(_config(files, "stem").output[0].dims) == [10]
    assert not tail.answers_task and tail.hand_over is not None and tail.hand_over.tail and tail.hand_over.link
    # With chain_answers: join (the default), the tail is a step after the head's, as in a chain that ends before its task.
    joined = generator.render(parse_plan_text(PLAN.read_text().replace("chain_answers: head\n", "")))
    assert [s.model_name for s in _config(joined, "task_a").ensemble_scheduling.step] == ["stem", "tail"]
    assert _spec(joined, "tail").hand_over == HandOver(takes_from="mid_b", keys_from=("stem",), from_link=True)


def test_a_task_whose_answer_is_too_large_for_a_message_keeps_its_join_and_the_plan_says_so() -> None:
    classes = ANSWER_MAX // 4 + 1
    plan = parse_plan_text(PLAN.read_text().replace("num_classes: 10", f"num_classes: {classes}"))
    files = generator.render(plan)
    assert [s.model_name for s in _config(files, "task_a").ensemble_scheduling.step] == ["stem", "tail"]
    assert [w.split(":")[0] for w in plan.warnings()] == ["tasks.task_a"] and "keeps its join 'tail'" in plan.warnings()[0]
    assert load_plan(PLAN).warnings() == []


def test_chain_answers_head_without_chains_is_named_as_having_no_effect() -> None:
    plan = parse_plan_text(PLAN.read_text().replace("hand_over: chain\n", ""))
    assert plan.warnings() == ["chain_answers: 'head' has no effect without hand_over: 'chain' (docs/plan.md, \"Chains\")"]


def test_answers_go_as_datagrams_and_a_malformed_one_ends_the_reading() -> None:
    key = b"k" * tk.MAC_BYTES
    answers = [answered(key, b"\x01" * 40), answer_failed(key[::-1], "x" * 5000), answered(key, b"\x02" * 8)]
    (one,) = pack_answers(answers)
    got = unpack_answers(one)
    assert got[0] == answers[0] and got[1][1] == b"x" * 4096 and got[2] == answers[2]
    assert unpack_answers(one[:-1]) == got[:2]  # the last one cut short is not read
    assert unpack_answers(b"") == [] and unpack_answers(b"\x00" * 7) == []
    many = pack_answers([answered(key, b"\x03" * ANSWER_MAX)] * 5)
    assert len(many) == 5 and all(len(d) <= DGRAM_MAX for d in many)
    assert sum(len(unpack_answers(d)) for d in many) == 5


def test_a_tail_answers_the_head_instance_each_hand_over_names_and_loses_only_what_has_nowhere_to_go(runtime: Path) -> None:
    heads = [AnswerIn(runtime, pid=os.getpid() * 4 + i) for i in range(2)]
    tail = AnswerOut(runtime)
    try:
        key = b"a" * tk.MAC_BYTES
        tail.send({heads[0].origin: [answered(key, b"\x05" * 16)],
                   heads[1].origin: [answered(key[::-1], b"\x06" * 16), answer_failed(key, "tail failed")],
                   ORIGIN.pack(1): [answered(key, b"\x07" * 16)],  # no such instance
                   NO_ORIGIN: [answered(key, b"\x08" * 16)]})  # a hand-over from a head that is not answered
        assert tail.lost == 2
        assert heads[0].wait(1.0) and heads[0].read() == [(key, HANDED, b"\x05" * 16)]
        assert heads[1].wait(1.0) and heads[1].read() == [(key[::-1], HANDED, b"\x06" * 16), (key, b"tail failed", b"")]
        assert not heads[0].wait(0.01)
    finally:
        tail.close()
        for h in heads:
            h.close()
    assert not any(h.path.exists() for h in heads)


def test_a_heads_hand_overs_name_it_as_their_origin_and_a_link_hands_on_the_origin_it_was_handed(runtime: Path) -> None:
    key = read_key(runtime)
    origin = ORIGIN.pack(31337)
    link = HandIn(runtime, "b1", HandOver(to="b2", takes_from="b0", keys_from=("b0",), link=True), key, 1.0, 10.0, pid=1)
    tail = HandIn(runtime, "b2", HandOver(takes_from="b1", keys_from=("b0",), link=True, tail=True), key, 1.0, 10.0, pid=2)
    head = HandOut(runtime, "b1", own_keys=True, one=True, origin=origin)
    relay = HandOut(runtime, "b2", one=True)
    try:
        head.begin()
        head.send([b"\x01" * tk.TICKET_BYTES])
        got = _take(link)
        assert [(s, o) for _, s, _, o in got] == [(HANDED, origin)]
        relay.begin()
        relay.take([got[0][0]], [got[0][3]])
        relay.send([b"\x02" * tk.TICKET_BYTES])
        relay.fail([b"f" * tk.MAC_BYTES], "gone", forwarded=True, origins=[origin])
        assert sorted((k, o) for k, _, _, o in _take(tail, 2)) == sorted([(got[0][0], origin), (b"f" * tk.MAC_BYTES, origin)])
    finally:
        for x in (head, relay, link, tail):
            x.close()


def _take(into: HandIn, n: int = 1) -> list[tuple[bytes, bytes, bytes, bytes]]:
    got: list[tuple[bytes, bytes, bytes, bytes]] = []
    deadline = time.monotonic() + 3
    while len(got) < n and time.monotonic() < deadline:
        got.extend(into.take_any(0.01, 32, stale_s=5.0))
    return got


# The head's side, with a stand-in for the Python backend's triton_python_backend_utils.

class _Response:
    def __init__(self, output_tensors: list[Any] | None = None, error: Any = None) -> None:
        self.outputs, self.error = output_tensors, error


class _Error:
    UNAVAILABLE = "UNAVAILABLE"

    def __init__(self, message: str, code: str | None = None) -> None:
        self.message, self.code = message, code


class _Tensor:
    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name, self.t = name, t

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> _Tensor:
        return cls(name, torch.utils.dlpack.from_dlpack(capsule))


@pytest.fixture()
def chain_answers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with with_pb_utils(monkeypatch, "blockflow.backend.chain_answers", InferenceResponse=_Response, Tensor=_Tensor,
                       TritonError=_Error) as module:
        yield module


def _ticket(i: int) -> bytes:
    t = bytearray(tk.TICKET_BYTES)
    t[tk.LAYOUT["mac"]] = bytes([i]) * tk.MAC_BYTES
    return bytes(t)


@contextmanager
def _head(runtime: Path, module: Any, classes: int, wait_s: float, logged: list[str] | None = None) -> Iterator[tuple[Any, AnswerIn, AnswerOut]]:
    """A head instance's answers (its task's logits of ``classes`` values) and a tail that sends them."""
    into, tail = AnswerIn(runtime, pid=os.getpid() * 4 + 3), AnswerOut(runtime)
    answers = module.ChainAnswers(into, [TaskOutput(name="LOGITS", shape=(classes,), dtype="fp32")], wait_s=wait_s, block="stem",
                                  log_error=(logged if logged is not None else []).append)
    try:
        yield answers, into, tail
    finally:
        tail.close()
        answers.close()


def test_a_heads_call_waits_for_every_answer_of_its_requests_and_builds_their_responses(runtime: Path, chain_answers: Any) -> None:
    with _head(runtime, chain_answers, classes=3, wait_s=5.0) as (answers, into, tail):
        tickets = [_ticket(i) for i in range(1, 4)]
        first, second = answers.expect([2, 1], tickets)  # requests of 2 and 1 samples
        rows = [np.array([i, i + 0.5, -i], dtype=np.float32).tobytes() for i in range(3)]
        key = lambda i: tickets[i][tk.LAYOUT["mac"]]  # noqa: E731
        # Out of order, after an answer for a key no call waits for, the last one late (from another thread).
        tail.send({into.origin: [answered(b"\x09" * tk.MAC_BYTES, rows[0]), answered(key(2), rows[2]), answered(key(0), rows[0])]})
        late = threading.Timer(0.1, tail.send, ({into.origin: [answered(key(1), rows[1])]},))
        late.start()
        answers.collect([first, second])
        late.join()
        assert answers.stale == 1 and first.why is None and second.why is None
        got = [answers.response(w) for w in (first, second)]
        assert [r.error for r in got] == [None, None]
        assert got[0].outputs[0].name == "LOGITS"
        assert np.array_equal(got[0].outputs[0].t.numpy(), np.frombuffer(rows[0] + rows[1], dtype=np.float32).reshape(2, 3))
        assert np.array_equal(got[1].outputs[0].t.numpy(), np.frombuffer(rows[2], dtype=np.float32).reshape(1, 3))
        assert answers.answered == 2
        answers.end_call()


def test_a_request_fails_alone_with_the_failure_it_was_handed_or_after_the_wait(runtime: Path, chain_answers: Any) -> None:
    logged: list[str] = []
    with _head(runtime, chain_answers, classes=2, wait_s=0.3, logged=logged) as (answers, into, tail):
        tickets = [_ticket(i) for i in range(1, 5)]
        failed, fine, silent = answers.expect([2, 1, 1], tickets)
        key = lambda i: tickets[i][tk.LAYOUT["mac"]]  # noqa: E731
        row = np.zeros(2, dtype=np.float32).tobytes()
        tail.send({into.origin: [answer_failed(key(0), "mid_a failed: out of memory"), answered(key(1), row),
                                 answered(key(2), row), answered(key(3), b"\x00" * 3)]})  # a short answer: refused
        t0 = time.monotonic()
        answers.collect([failed, fine, silent])
        assert time.monotonic() - t0 < 0.25  # nothing left to wait for once each request is decided
        assert failed.why == "mid_a failed: out of memory" and fine.why is None and silent.why == "an answer of 3 bytes"
        tail.send({into.origin: [answered(key(1), row)]})  # late, for a request that failed: the next call drops it
        answers.end_call()
        assert into.wait(1.0)
        stale = answers.stale
        _, again = answers.expect([1, 1], [_ticket(7), _ticket(8)])
        assert answers.stale == stale + 1 and not into.wait(0.0)
        answers.collect([again])
        assert again.why is not None and "no answer from the chain's tail within 0.3 s" in again.why and answers.expired == 1
        assert logged == ["blockflow: stem: 1 request(s) got no answer from the chain's tail within 0.3 s (1 so far)"]
        responses = [answers.response(w) for w in (failed, fine, silent, again)]
        assert [r.error is None for r in responses] == [False, True, False, False]
        assert "mid_a failed: out of memory" in responses[0].error.message and responses[0].error.code == "UNAVAILABLE"


def test_a_head_that_waits_for_answers_fails_its_batch_at_once_where_no_link_listens(runtime: Path) -> None:
    head = HandOut(runtime, "gone", own_keys=True, one=True, origin=ORIGIN.pack(4242))
    try:
        head.begin()
        head.send([b"\x01" * tk.TICKET_BYTES])  # a sender that does not wait: nothing to say
        head.begin()
        with pytest.raises(NoReceiverError, match="no instance of block 'gone' is running"):
            head.send([b"\x01" * tk.TICKET_BYTES], must_reach=True)
    finally:
        head.close()
