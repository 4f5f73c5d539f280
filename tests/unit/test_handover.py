"""Direct hand-overs: which pairs of blocks qualify, how their ensembles are wired, and the runtime's
two sides over real ZeroMQ sockets (the served case is tests/integration/test_any_model.py's
hand_over plan)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.handout import HandOut, keys_of
from blockflow.backend.tensormq.handover import LATE_S, LOOK_AFTER_S, HandIn, Relay
from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.tensormq.ticket import ProducerGoneError, TicketError
from blockflow.backend.tensormq.wire import DGRAM_MAX, ORIGIN, failed, handed, pack_datagrams, unpack_datagram
from blockflow.core import also_accepts, env
from blockflow.core.runtime_dir import ensure_tensormq, read_key
from blockflow.core.spec import HandOver, ModelSpec
from blockflow.ensemble_gen import generator
from blockflow.plan import direct_pairs, load_plan, parse_plan, parse_plan_text

ROOT = Path(__file__).resolve().parents[2]
CHAIN = {"t": ["b0", "b1", "b2", "b3", "b4"]}


def test_a_chain_hands_over_between_its_middle_blocks_and_its_head_joins() -> None:
    relay = direct_pairs.pairs(CHAIN)
    assert relay == {"b1": "b2", "b2": "b3"}  # b1 takes b0's ticket; b4 is last
    w = direct_pairs.wiring(CHAIN["t"], relay)
    assert w.takes == (None, 0, 0, 0, 3) and w.after == {4: (1, 2)}
    roles = direct_pairs.roles(CHAIN, relay)
    assert roles["b1"] == HandOver(to="b2")
    assert roles["b2"] == HandOver(to="b3", takes_from="b1", keys_from=("b0",))
    assert roles["b3"] == HandOver(takes_from="b2", keys_from=("b0",))
    assert roles["b4"] == HandOver(after=2) and "b0" not in roles


@pytest.mark.parametrize(("paths", "packs"), [
    ({"t": ["b0", "b1", "b2"]}, set()),  # three blocks: the receiver would be the last
    ({"t": ["b0", "b1", "b2", "b3"], "u": ["b0", "b1", "c2", "c3"]}, set()),  # b1 has two blocks after it
    ({"t": ["b0", "b1", "b2", "b3"], "u": ["c0", "c1", "b2", "b3"]}, set()),  # b2 has two blocks before it
    ({"t": ["b0", "b1", "b2", "b3"], "u": ["b1", "b2", "b3"]}, set()),  # b2 is u's second block: no key
    ({"t": ["b0", "b1", "b2", "b3"], "u": ["c0", "b1", "b2"]}, set()),  # b2 is u's last block
    ({"t": ["b0", "b1", "p", "b3"]}, {"p"}),  # a head pack
])
def test_pairs_whose_part_differs_between_tasks_keep_their_ensemble_step(paths: dict[str, list[str]], packs: set[str]) -> None:
    assert direct_pairs.pairs(paths, packs) == {}


def test_a_run_that_starts_later_is_keyed_by_its_senders_input_and_tasks_may_start_apart() -> None:
    paths = {"t": ["a0", "x", "s", "r", "j"], "u": ["c0", "x", "s", "r", "j"], "v": ["a0", "x", "k"]}
    relay = direct_pairs.pairs(paths)
    assert relay == {"s": "r"}  # x has two blocks after it
    w = direct_pairs.wiring(paths["t"], relay)
    assert w.takes == (None, 0, 1, 1, 3) and w.after == {4: (2,)}
    assert direct_pairs.roles(paths, relay)["r"] == HandOver(takes_from="s", keys_from=("x",))


def _spec(config: bytes) -> dict[str, object]:
    text = config.decode()
    raw = re.search(r'key: "blockflow.spec"\s*value \{\s*string_value: "(.*)"', text)
    assert raw is not None
    return dict(json.loads(raw.group(1).encode().decode("unicode_escape")))


def test_the_generator_wires_direct_hand_overs_on_tensormq_only() -> None:
    files = generator.render(load_plan(ROOT / "tests" / "plans" / "hand_over.yaml"))
    task = files["task_a/config.pbtxt"].decode()
    inputs = re.findall(r'model_name: "(\w+)".*?((?:input_map \{.*?\}\s*)+)', task, re.S)
    assert [(m, re.findall(r'value: "(\w+)"', maps)) for m, maps in inputs] == [
        ("stem", ["IMAGE"]), ("mid_a", ["hop0_stem"]), ("mid_b", ["hop0_stem"]), ("mid_c", ["hop0_stem"]),
        ("head_a", ["hop3_mid_c", "hop1_mid_a", "hop2_mid_b"])]
    assert _spec(files["mid_b/config.pbtxt"])["hand_over"] == {"to": "mid_c", "takes_from": "mid_a", "keys_from": ["stem"], "after": 0}
    head = files["head_b/config.pbtxt"].decode()
    assert head.count("optional: true") == 2 and "HANDED_AFTER_1" in head
    cpu = [p for p in files if p.startswith("task_a__") and p.endswith("config.pbtxt")]
    assert cpu and all("hop0_stem" not in files[p].decode().split("mid_b")[1].split("output_map")[0] for p in cpu)
    assert all("hand_over" not in _spec(files[p]) for p in files if p.endswith("config.pbtxt") and "__" in p.split("/")[0]
               and "platform" not in files[p].decode())


# ---------------------------------------------------------------------------- the runtime, over real sockets


@pytest.fixture(params=["zmq", "dgram"])
def runtime(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime directory; every test of the runtime runs with hand-overs over ZeroMQ and as datagrams."""
    if request.param == "dgram":
        monkeypatch.delenv(env.TMQ_HANDOVER_DGRAM, raising=False)  # the default
    else:
        monkeypatch.setenv(env.TMQ_HANDOVER_DGRAM, "0")
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    ensure_tensormq(rt)
    yield rt
    for prod in _PRODUCERS.pop(rt, []):
        prod.close()


_PRODUCERS: dict[Path, list[Producer]] = {}


def _key_ticket(runtime: Path, claim_s: float = 30.0) -> np.ndarray:
    """A real ticket of block b0 (a committed batch of one, in a host pool): the key of a hand-over."""
    prods = _PRODUCERS.setdefault(runtime, [])
    found = [p for p in prods if p.claim_s == claim_s]
    if not found:
        found = [Producer(f"b0/{len(prods)}", runtime, torch.device("cpu"), pool_bytes=1 << 16, max_slots=16, lease_s=30,
                          wait_s=1, claim_s=claim_s, prepare=False)]
        prods.extend(found)
    prod = found[0]
    raw = prod.commit(prod.reserve((1, 4), torch.float32), 0)[0]
    return np.frombuffer(raw, dtype=np.uint8).reshape(1, -1).copy()


ROLE = HandOver(takes_from="b1", keys_from=("b0",))


def test_a_receiver_takes_the_senders_ticket_for_its_key_once(runtime: Path) -> None:
    key = read_key(runtime)
    into = HandIn(runtime, "b2", ROLE, key, wait_s=2.0, keep_s=10.0)
    out = HandOut(runtime, "b2")
    try:
        rows = np.concatenate([_key_ticket(runtime), _key_ticket(runtime)])
        handed = [bytes([i]) * tk.TICKET_BYTES for i in (7, 8)]
        out.begin()
        out.take(keys_of(rows))
        out.send(handed)
        got = into.resolve(rows)
        assert [bytes(r) for r in got] == handed
        with pytest.raises(TicketError, match="replayed"):
            into.resolve(rows[:1])
        own = np.frombuffer(handed[0], dtype=np.uint8).reshape(1, -1)  # not a key: passed on as it is
        assert into.resolve(own) is own
        forged = rows[:1].copy()
        forged[0, 40] ^= 1
        with pytest.raises(TicketError, match="signature"):
            into.resolve(forged)
    finally:
        out.close()
        into.close()
    assert not into.path.exists()


def test_a_receiver_takes_other_blocks_tickets_as_keys_while_its_file_says_so(runtime: Path, tmp_path: Path) -> None:
    """During a live plan change that gave the sender another feeder (h for b0), the old ensemble
    still gives the receiver b0's tickets as keys: it treats them as keys while the file apply writes
    beside its config names b0 (blockflow.core.also_accepts), and passes them on as they are otherwise."""
    key = read_key(runtime)
    file = tmp_path / also_accepts.FILE
    into = HandIn(runtime, "b2", HandOver(takes_from="b1", keys_from=("h",)), key, wait_s=2.0, keep_s=10.0,
                  also=also_accepts.Reader(file))
    out = HandOut(runtime, "b2")
    try:
        rows = _key_ticket(runtime)
        assert into.resolve(rows) is rows  # not a key of this receiver: the consumer will refuse it
        also_accepts.write(tmp_path, also_accepts.AlsoAccepts(keys=("b0",), until=time.time() + 30))
        handed = [bytes([7]) * tk.TICKET_BYTES]
        out.begin()
        out.take(keys_of(rows))
        out.send(handed)
        assert [bytes(r) for r in into.resolve(rows)] == handed
        also_accepts.write(tmp_path, also_accepts.AlsoAccepts(keys=("b0",), until=time.time() - 1))
        later = _key_ticket(runtime)
        assert into.resolve(later) is later
    finally:
        out.close()
        into.close()


def test_a_senders_failure_fails_the_request_at_once_and_a_missing_hand_over_after_the_wait(runtime: Path) -> None:
    key = read_key(runtime)
    into = HandIn(runtime, "b2", ROLE, key, wait_s=1.5, keep_s=10.0)
    out = HandOut(runtime, "b2")
    try:
        failed, lost, late = _key_ticket(runtime), _key_ticket(runtime), _key_ticket(runtime)
        out.begin()
        out.take(keys_of(late))
        out.fail(keys_of(failed), "ticket signature does not verify")
        out.finish("the batch failed before its tickets were issued")  # `late` was read, never sent
        t0 = time.monotonic()
        with pytest.raises(ProducerGoneError, match="signature does not verify"):
            into.resolve(failed)
        with pytest.raises(ProducerGoneError, match="batch failed"):
            into.resolve(late)
        assert time.monotonic() - t0 < 1.0  # at once, not after the wait
        with pytest.raises(ProducerGoneError, match="did not hand over"):
            into.resolve(lost)
        assert time.monotonic() - t0 >= 1.5
    finally:
        out.close()
        into.close()


def test_every_receiver_instance_hears_every_hand_over_and_forgets_what_it_was_not_asked(runtime: Path) -> None:
    key = read_key(runtime)
    first = HandIn(runtime, "b2", ROLE, key, wait_s=2.0, keep_s=0.2, pid=1)
    out = HandOut(runtime, "b2")
    second = HandIn(runtime, "b2", ROLE, key, wait_s=2.0, keep_s=0.2, pid=2)  # started after the sender listed
    other = HandIn(runtime, "b9", ROLE, key, wait_s=0.2, keep_s=0.2, pid=3)  # another block: hears nothing of b2's
    try:
        rows = [_key_ticket(runtime) for i in range(3)]
        out.begin()
        for r in rows:
            out.take(keys_of(r))
        out.send([bytes([i]) * tk.TICKET_BYTES for i in range(3)])
        assert bytes(first.resolve(rows[0])[0]) == bytes([0]) * tk.TICKET_BYTES
        assert bytes(second.resolve(rows[1])[0]) == bytes([1]) * tk.TICKET_BYTES
        with pytest.raises(ProducerGoneError):
            other.resolve(rows[2])
        time.sleep(1.0)  # past keep_s and two of the idle thread's rounds: it read and then forgot the rest
        assert not first.pending and not second.pending
        assert not first.served  # served keys are forgotten too, after the same window
    finally:
        for x in (out, first, second, other):
            x.close()


def test_a_key_whose_hand_over_cannot_come_any_more_fails_without_the_wait(runtime: Path) -> None:
    """A key replayed after its claim window (its served entry forgotten by then) and a key of a
    producer that stopped fail within a look at the key's claim table, not after the wait."""
    key = read_key(runtime)
    into = HandIn(runtime, "b2", ROLE, key, wait_s=20.0, keep_s=0.3)
    out = HandOut(runtime, "b2")
    try:
        rows = _key_ticket(runtime, claim_s=0.3)
        out.begin()
        out.take(keys_of(rows))
        out.send([bytes([5]) * tk.TICKET_BYTES])
        assert bytes(into.resolve(rows)[0]) == bytes([5]) * tk.TICKET_BYTES
        time.sleep(0.3 + LATE_S + 0.3)  # past the window and its grace: the served key is forgotten too
        t0 = time.monotonic()
        with pytest.raises(TicketError, match="expired ticket.*hand-over from block b1"):
            into.resolve(rows)
        fresh = _key_ticket(runtime)  # its window is open: the hand-over may still come
        _PRODUCERS[runtime].pop().close()  # the producer of `fresh`
        with pytest.raises(ProducerGoneError, match="stale key: producer"):
            into.resolve(fresh)
        assert time.monotonic() - t0 < 2.0  # against a wait of 20 s
    finally:
        out.close()
        into.close()


def test_a_later_receiver_of_a_run_waits_for_its_sender_after_the_keys_slot_moved_on(runtime: Path) -> None:
    """In a run a -> b -> c keyed by a's input, a releases the key's sample (its slot is reused)
    before b hands over to c: c must go on waiting for b, not fail the key as stale."""
    import threading

    from blockflow.backend.tensormq.consumer import Consumer

    key = read_key(runtime)
    prod = Producer("b0/solo", runtime, torch.device("cpu"), pool_bytes=1 << 12, max_slots=1, lease_s=30, wait_s=1,
                    claim_s=30, prepare=False)
    first = Consumer(runtime, torch.device("cpu"))  # the run's first sender, which claims the key
    into = HandIn(runtime, "b2", ROLE, key, wait_s=5.0, keep_s=10.0)
    out = HandOut(runtime, "b2")
    try:
        rows = np.frombuffer(prod.commit(prod.reserve((1, 4), torch.float32), 0)[0], dtype=np.uint8).reshape(1, -1).copy()
        _, rel = first.gather(rows, (4,), 0)
        first.release_now(rel)
        first.flush()
        deadline = time.monotonic() + 5
        while prod.usage()[1] and time.monotonic() < deadline:
            time.sleep(0.01)
        prod.commit(prod.reserve((1, 4), torch.float32), 0)  # the one slot, its next use

        def later() -> None:  # the run's second sender, queued behind other work
            time.sleep(LOOK_AFTER_S + 0.3)
            out.begin()
            out.take(keys_of(rows))
            out.send([bytes([9]) * tk.TICKET_BYTES])

        sender = threading.Thread(target=later)
        sender.start()
        assert bytes(into.resolve(rows)[0]) == bytes([9]) * tk.TICKET_BYTES
        sender.join()
    finally:
        out.close()
        into.close()
        first.close()
        prod.close()


def test_a_senders_read_that_fails_for_any_reason_is_handed_on_at_once(runtime: Path) -> None:
    """A sender whose read of a request fails with something other than a bad ticket (a CUDA error,
    say) hands that failure on: the receiver's request fails with it at once, not after the wait."""
    into = HandIn(runtime, "b2", ROLE, read_key(runtime), wait_s=1.5, keep_s=10.0)
    relay = Relay(HandOut(runtime, "b2"), None)
    try:
        rows = _key_ticket(runtime)

        def broken(_: object) -> object:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        relay.begin()
        with pytest.raises(RuntimeError):
            relay.read(rows, broken)
        t0 = time.monotonic()
        with pytest.raises(ProducerGoneError, match="illegal memory access"):
            into.resolve(rows)
        assert time.monotonic() - t0 < 1.0
    finally:
        relay.close()
        into.close()


def test_the_requests_of_one_call_share_one_wait_for_their_hand_overs(runtime: Path) -> None:
    """Keys that never reached the sender (a client took them from the first block itself) hold a
    receiver's call for the wait once, however many of its requests carry them; a hand-over that
    came is still taken after the wait ran out, and the next call waits afresh."""
    key = read_key(runtime)
    relay = Relay(HandOut(runtime, "b9"), HandIn(runtime, "b2", ROLE, key, wait_s=0.6, keep_s=10.0))
    out = HandOut(runtime, "b2")
    try:
        lost = [_key_ticket(runtime) for _ in range(3)]
        came = _key_ticket(runtime)
        out.begin()
        out.take(keys_of(came))
        out.send([bytes([9]) * tk.TICKET_BYTES])
        relay.begin()
        t0 = time.monotonic()
        for rows in lost:
            with pytest.raises(ProducerGoneError, match="did not hand over"):
                relay.read(rows, lambda t: t)
        assert 0.6 <= time.monotonic() - t0 < 1.0  # one wait for the call, not three
        assert bytes(relay.read(came, lambda t: t)[0]) == bytes([9]) * tk.TICKET_BYTES
        relay.begin()
        t0 = time.monotonic()
        with pytest.raises(ProducerGoneError, match="did not hand over"):
            relay.read(_key_ticket(runtime), lambda t: t)
        assert time.monotonic() - t0 >= 0.6
    finally:
        out.close()
        relay.close()


def test_a_task_may_keep_its_steps_and_a_plan_that_finds_no_pair_says_so() -> None:
    raw = load_plan(ROOT / "tests" / "plans" / "hand_over.yaml").raw.model_dump(mode="json", exclude_none=True)
    raw["tasks"]["task_b"]["hand_over"] = "ensemble"  # task_b runs the same blocks: none of them hands over
    plan = parse_plan(raw)
    files = generator.render(plan)
    assert "hop0_stem" not in files["task_a/config.pbtxt"].decode().split('"mid_b"')[1]
    assert all("hand_over" not in _spec(files[f"{m}/config.pbtxt"]) for m in ("mid_a", "mid_b", "mid_c", "head_a"))
    assert [w.split(":")[0] for w in plan.warnings()] == ["tasks.task_a"]
    raw["tasks"]["task_b"]["hand_over"] = "direct"
    raw["tasks"]["task_b"]["transport"] = "triton-cpu"
    assert any("needs transport 'tensormq'" in w for w in parse_plan(raw).warnings())
    direct = load_plan(ROOT / "tests" / "plans" / "hand_over.yaml")
    assert not direct.warnings()
    # What `blockflow show` lists is what the generator wires.
    assert direct.hand_overs == {"mid_a": "mid_b", "mid_b": "mid_c"}
    assert direct.task_hand_overs(direct.tasks["task_b"]) == [("mid_a", "mid_b"), ("mid_b", "mid_c")]


def test_datagrams_carry_a_calls_hand_overs_and_a_malformed_tail_is_dropped() -> None:
    key = bytes(range(tk.MAC_BYTES))
    messages = [handed(key, b"\x07" * tk.TICKET_BYTES, ORIGIN.pack(77)), failed(key[::-1], "batch failed")]
    (one,) = pack_datagrams(messages)
    assert unpack_datagram(one) == [tuple(m) for m in messages]
    assert unpack_datagram(one[:-1]) == [tuple(messages[0])]  # the cut failure is not read
    assert unpack_datagram(b"") == [] and unpack_datagram(b"\x00" * 5) == []
    many = pack_datagrams([handed(key, b"\x01" * tk.TICKET_BYTES)] * 1000)
    assert len(many) > 1 and all(len(d) <= DGRAM_MAX for d in many)
    assert sum(len(unpack_datagram(d)) for d in many) == 1000


def test_a_receivers_full_datagram_queue_sends_the_rest_over_zeromq_and_loses_nothing(runtime: Path) -> None:
    if os.environ.get(env.TMQ_HANDOVER_DGRAM) == "0":
        pytest.skip("datagrams only")
    key = read_key(runtime)
    into = HandIn(runtime, "b2", ROLE, key, wait_s=2.0, keep_s=10.0)
    out = HandOut(runtime, "b2")
    try:
        assert into.dgram_path.exists()
        keys = [_key_ticket(runtime) for _ in range(14)]  # the producer has 16 slots; the queue holds 10 here
        for i, rows in enumerate(keys):  # one call each, while the receiver reads nothing
            out.begin()
            out.take(keys_of(rows))
            out.send([bytes([i]) * tk.TICKET_BYTES])
        qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
        if qlen < len(keys):
            assert out.by_zmq > 0
        for i, rows in enumerate(keys):
            assert bytes(into.resolve(rows)[0]) == bytes([i]) * tk.TICKET_BYTES
    finally:
        out.close()
        into.close()
    assert not into.dgram_path.exists() and not into.path.exists()


# ---------------------------------------------------------------------------- chains (hand_over: chain)


def test_a_chains_links_are_its_middle_blocks_its_head_keys_by_its_own_tickets_and_its_join_is_the_next_step() -> None:
    relay = direct_pairs.pairs(CHAIN, chain=True)
    assert relay == {"b0": "b1", "b1": "b2", "b2": "b3"}  # b1 may be the second block; b4, the last, is a step
    assert direct_pairs.chain_steps(CHAIN["t"], relay) == ["b0", "b4"]
    roles = direct_pairs.chain_roles(CHAIN, relay)
    assert roles["b0"] == HandOver(to="b1", own_keys=True, to_link=True)
    assert roles["b1"] == HandOver(to="b2", takes_from="b0", keys_from=("b0",), link=True, to_link=True)
    assert roles["b3"] == HandOver(to="b4", takes_from="b2", keys_from=("b0",), link=True)
    assert roles["b4"] == HandOver(takes_from="b3", keys_from=("b0",), from_link=True)


@pytest.mark.parametrize("paths", [
    {"t": ["b0", "b1", "b2", "b3"], "u": ["b0", "b1", "c2", "c3"]},  # b1 has two blocks after it
    {"t": ["b0", "b1", "b2", "b3"], "u": ["c0", "c1", "b2", "b3"]},  # b2 has two blocks before it
    {"t": ["b0", "b1", "b2"], "u": ["c0", "c1", "b2"]},  # b2 would join two chains
    {"t": ["b0", "b1"]},  # no middle block
])
def test_a_block_whose_neighbours_differ_between_tasks_is_no_link(paths: dict[str, list[str]]) -> None:
    assert direct_pairs.pairs(paths, chain=True) == {}


def test_shared_blocks_stay_steps_and_a_tasks_own_tail_chains_from_its_first_own_block() -> None:
    paths = {"t": ["s", "t1", "t2", "t3"], "u": ["s", "u1", "u2", "u3"]}
    relay = direct_pairs.pairs(paths, chain=True)
    assert relay == {"t1": "t2", "u1": "u2"}
    roles = direct_pairs.chain_roles(paths, relay)
    assert roles["t1"] == HandOver(to="t2", own_keys=True, to_link=True)
    assert roles["t3"] == HandOver(takes_from="t2", keys_from=("t1",), from_link=True) and "s" not in roles
    assert direct_pairs.chain_steps(paths["u"], relay) == ["s", "u1", "u3"]


def test_the_generator_leaves_a_chains_links_out_of_its_ensemble() -> None:
    files = generator.render(load_plan(ROOT / "tests" / "plans" / "chain.yaml"))
    task = files["task_a/config.pbtxt"].decode()
    inputs = re.findall(r'model_name: "(\w+)".*?((?:input_map \{.*?\}\s*)+)', task, re.S)
    assert [(m, re.findall(r'value: "(\w+)"', maps)) for m, maps in inputs] == [
        ("stem", ["IMAGE"]), ("mid_c", ["hop0_stem"]), ("head_a", ["hop1_mid_c"])]
    assert _spec(files["mid_a/config.pbtxt"])["hand_over"] == {
        "to": "mid_b", "takes_from": "stem", "keys_from": ["stem"], "after": 0, "link": True, "to_link": True}
    assert _spec(files["mid_c/config.pbtxt"])["hand_over"] == {"takes_from": "mid_b", "keys_from": ["stem"], "to": "", "after": 0, "from_link": True}
    assert "hand_over" not in _spec(files["head_a/config.pbtxt"])


def test_a_sender_of_hand_overs_and_a_link_never_answer_early() -> None:
    files = generator.render(load_plan(ROOT / "tests" / "plans" / "chain.yaml"))
    early = {m: ModelSpec.model_validate(_spec(files[f"{m}/config.pbtxt"])).answers_early
             for m in ("stem", "mid_a", "mid_b", "mid_c")}
    # The head hands over to a link, which waits for its commit; the links answer nobody; the join's
    # next block (a task's head) is an ensemble step.
    assert early == {"stem": False, "mid_a": False, "mid_b": False, "mid_c": True}
    plain = generator.render(parse_plan_text((ROOT / "tests" / "plans" / "chain.yaml").read_text().replace(
        "hand_over: chain", "hand_over: ensemble")))
    assert ModelSpec.model_validate(_spec(plain["stem/config.pbtxt"])).answers_early


def test_a_plan_hands_over_one_way_beyond_the_ensemble() -> None:
    text = (ROOT / "tests" / "plans" / "chain.yaml").read_text()
    text = text.replace("  task_b: {path: [stem, mid_a, mid_b, mid_c, head_b]}",
                        "  task_b: {path: [stem, mid_a, mid_b, mid_c, head_b], hand_over: direct}")
    with pytest.raises(Exception, match="hand over one way"):
        parse_plan_text(text)


def test_a_links_instances_take_a_senders_calls_in_turn_and_each_key_once(runtime: Path) -> None:
    key = read_key(runtime)
    role = HandOver(to="b2", takes_from="b0", keys_from=("b0",), link=True)
    first = HandIn(runtime, "b1", role, key, wait_s=1.0, keep_s=10.0, pid=1)
    second = HandIn(runtime, "b1", role, key, wait_s=1.0, keep_s=10.0, pid=2)
    out = HandOut(runtime, "b1", own_keys=True, one=True)
    try:
        calls = [[bytes([c * 8 + i]) * tk.TICKET_BYTES for i in range(3)] for c in range(4)]
        for tickets in calls:
            out.begin()
            out.send(tickets)  # keyed by the tickets themselves
        out.fail([b"k" * 16], "gone", forwarded=True)
        got: list[list[tuple[bytes, bytes, bytes]]] = [[], []]
        deadline = time.monotonic() + 3
        while sum(map(len, got)) < 13 and time.monotonic() < deadline:
            for g, into in zip(got, (first, second), strict=True):
                g.extend(into.take_any(0.01, 32, stale_s=5.0))
        assert sorted(len(g) for g in got) == [6, 7]  # whole calls, alternately; the failure to one
        heard = [m for g in got for m in g]
        assert sorted(t for k, s, t, _ in heard if s == b"") == sorted(t for c in calls for t in c)
        assert all(k == t[tk.LAYOUT["mac"]] for k, s, t, _ in heard if s == b"")
        assert [s for k, s, _, _ in heard if k == b"k" * 16] == [b"gone"]  # handed on as it was
        assert not first.take_any(0.01, 32, stale_s=5.0) and not second.take_any(0.01, 32, stale_s=5.0)  # nothing twice
    finally:
        for x in (out, first, second):
            x.close()


def test_a_plan_that_spans_servers_has_no_chains() -> None:
    text = (ROOT / "tests" / "plans" / "chain.yaml").read_text() + "servers:\n  one: {grpc: 'localhost:8001'}\n  two: {grpc: 'localhost:9001'}\n"
    with pytest.raises(Exception, match="within one server"):
        parse_plan_text(text)


def test_a_links_sender_skips_a_killed_instance_and_a_stale_hand_over_comes_as_failed(runtime: Path) -> None:
    key = read_key(runtime)
    role = HandOver(to="b2", takes_from="b0", keys_from=("b0",), link=True)
    live = HandIn(runtime, "b1", role, key, wait_s=1.0, keep_s=10.0, pid=1)
    dead = HandIn(runtime, "b1", role, key, wait_s=1.0, keep_s=10.0, pid=2)
    out = HandOut(runtime, "b1", own_keys=True, one=True)
    try:
        out.begin()
        out.send([])  # nothing to send: the sender has not listed them yet
        assert len(out._receivers()) == 2
        dead._closed.set()  # killed: nobody listens, and its files stay
        dead._idle.join()
        dead.sock.close(0)
        if dead.dgram is not None:
            dead.dgram.close()
        for path in (dead.path, dead.dgram_path):
            path.unlink(missing_ok=True)
            path.write_bytes(b"")
        calls = [[bytes([c * 4 + i]) * tk.TICKET_BYTES for i in range(2)] for c in range(6)]
        for tickets in calls:
            out.begin()
            out.send(tickets)
        got: list[tuple[bytes, bytes, bytes, bytes]] = []
        deadline = time.monotonic() + 3
        while len(got) < 12 and time.monotonic() < deadline:
            got.extend(live.take_any(0.01, 32, stale_s=5.0))
        assert sorted(t for _, _, t, _ in got) == sorted(t for c in calls for t in c)  # every call, none to the dead one
        out.begin()
        out.send([b"\xee" * tk.TICKET_BYTES])
        time.sleep(0.05)
        with live._lock:
            live._drain()  # heard now (the idle thread would, if nothing took it)
        time.sleep(0.1)
        (stale,) = live.take_any(0.01, 32, stale_s=0.05)
        assert stale[1].startswith(b"not run: it waited over 0.05 s in block b1's queue")
    finally:
        out.close()
        live.close()
        dead.remove_file()
