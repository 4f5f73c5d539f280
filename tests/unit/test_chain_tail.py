"""A chain that ends its tasks (hand_over: chain, chain_answers: head): its last block is a link, the tail,
and answers the head instance that took each request; which blocks qualify, how the plan is
rendered, and the answers' wire and sockets (the served case is tests/integration/test_any_model.py's
chain_tail plan; on the GPU, tests/gpu/test_chain_gpu.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.answers import AnswerIn, AnswerOut
from blockflow.backend.tensormq.handout import HandOut
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
from blockflow.core.runtime_dir import ensure_tensormq, read_key
from blockflow.core.spec import ANSWER_MAX, HandOver, ModelSpec
from blockflow.ensemble_gen import generator
from blockflow.plan import direct_pairs, load_plan, parse_plan_text

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "tests" / "plans" / "chain_tail.yaml"
CHAIN = {"t": ["b0", "b1", "b2", "b3", "b4"]}


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Path]:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    ensure_tensormq(rt)
    yield rt


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
    # With chain_answers: join, the tail is a step after the head's, as in a chain that ends before its task.
    joined = generator.render(parse_plan_text(PLAN.read_text() + "chain_answers: join\n"))
    assert [s.model_name for s in _config(joined, "task_a").ensemble_scheduling.step] == ["stem", "tail"]
    assert _spec(joined, "tail").hand_over == HandOver(takes_from="mid_b", keys_from=("stem",), from_link=True)


def test_a_task_whose_answer_is_too_large_for_a_message_keeps_its_join() -> None:
    classes = ANSWER_MAX // 4 + 1
    files = generator.render(parse_plan_text(PLAN.read_text().replace("num_classes: 10", f"num_classes: {classes}")))
    assert [s.model_name for s in _config(files, "task_a").ensemble_scheduling.step] == ["stem", "tail"]


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
