"""TensorMQ on the CPU twin (POSIX shared memory): tickets, slots, and the protocol across real processes and ZeroMQ."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.memory import SHM_DIR
from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.tensormq.reservation import PoolExhaustedError
from blockflow.backend.tensormq.slots import ALIGN, SlotTable
from blockflow.backend.tensormq.ticket import ProducerGoneError, TicketError
from blockflow.backend.tensormq.wire import STATS, endpoint, generations
from blockflow.core import also_accepts, cuda, env
from blockflow.core.errors import BlockError
from blockflow.core.runtime_dir import ensure_tensormq

KEY = b"k" * 32
CPU = torch.device("cpu")


def sample_ticket(**over: object) -> tk.Ticket:
    base: dict[str, object] = {"producer": 0x1234, "generation": 7, "slot": 3, "seq": 9, "sample": 0, "offset": 4096,
                               "nbytes": 2 * 3 * 4 * 4, "dtype": torch.float32, "shape": (2, 3, 4),
                               "device_type": tk.DEVICE_HOST, "device_index": 0}
    base.update(over)
    return tk.Ticket(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- tickets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_ticket_round_trip(dtype: torch.dtype) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    t = sample_ticket(dtype=dtype, shape=(256, 56, 56), nbytes=256 * 56 * 56 * size, offset=512)
    raw = tk.encode(t, KEY)
    assert len(raw) == tk.TICKET_BYTES
    assert tk.decode(raw, KEY) == t


def _resign(body: bytearray) -> bytes:
    """A mutated body with a valid MAC: what a holder of the key could forge."""
    b = bytes(body[:240])
    return b + tk._mac(KEY, b)


def test_ten_thousand_random_and_mutated_tickets_fail_cleanly() -> None:
    rng = random.Random(1234)
    good = bytearray(tk.encode(sample_ticket(), KEY))
    kinds = {"random": 0, "flipped": 0, "resigned": 0, "length": 0}
    for i in range(10_000):
        mode = i % 4
        if mode == 0:
            raw = bytes(rng.getrandbits(8) for _ in range(256))
            kinds["random"] += 1
        elif mode == 1:
            b = bytearray(good)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(256)] ^= 1 << rng.randrange(8)
            raw = bytes(b)
            kinds["flipped"] += 1
        elif mode == 2:
            b = bytearray(good)
            pos = rng.randrange(4, 240)  # keep the magic so the deeper checks run
            b[pos] = (b[pos] + rng.randint(1, 255)) % 256
            raw = _resign(b)
            kinds["resigned"] += 1
        else:
            raw = bytes(good[: rng.randrange(256)]) if rng.random() < 0.5 else bytes(good) + b"\0"
            kinds["length"] += 1
        try:
            t = tk.decode(raw, KEY)
        except TicketError as exc:
            assert str(exc)
            continue
        # A re-signed mutation of a field that no check constrains (ids, slot, offset) still decodes;
        # the consumer then checks it against the producer (bounds, generation): see the tests below.
        assert mode == 2 and t != sample_ticket()
    assert all(v == 2500 for v in kinds.values())


@pytest.mark.parametrize(("over", "fragment"), [
    ({"nbytes": 10}, "needs"),
    ({"offset": 4098}, "not aligned"),
])
def test_inconsistent_signed_tickets_are_refused(over: dict[str, object], fragment: str) -> None:
    t = sample_ticket(**over)
    with pytest.raises(TicketError, match=fragment):
        tk.decode(tk.encode(t, KEY), KEY)


def test_wrong_key_is_refused() -> None:
    with pytest.raises(TicketError, match="signature"):
        tk.decode(tk.encode(sample_ticket(), KEY), b"x" * 32)


# ---------------------------------------------------------------------------- slots


def test_slot_table_allocates_frees_and_coalesces() -> None:
    table = SlotTable(capacity=8 * ALIGN, max_slots=4)
    a = table.allocate(ALIGN, samples=2, deadline=10)
    b = table.allocate(3 * ALIGN - 7, samples=1, deadline=10)
    c = table.allocate(4 * ALIGN, samples=1, deadline=10)
    assert a and b and c and (a.offset, b.offset, c.offset) == (0, ALIGN, 4 * ALIGN)
    assert table.allocate(1, 1, 10) is None  # full
    table.release_all(a.index, a.seq + 1)  # another use of the slot: nothing
    assert a.index in table.live and a.samples == 2
    table.release_all(a.index, a.seq)
    table.release_all(b.index, b.seq)
    assert a.index not in table.live and b.index not in table.live
    big = table.allocate(4 * ALIGN, 1, 10)  # a and b coalesced into one 4-ALIGN range
    assert big is not None and big.offset == 0 and big.seq == 2  # a reused index gets a new sequence number
    assert [s.index for s in table.reap(now=11)] and table.bytes_in_use == 0


def test_slot_table_tells_when_its_next_slot_falls_due() -> None:
    table = SlotTable(capacity=8 * ALIGN, max_slots=4)
    assert table.next_due() == float("inf")
    a = table.allocate(ALIGN, samples=1, deadline=10)
    assert a is not None and table.allocate(ALIGN, samples=1, deadline=7) is not None
    assert table.next_due() == 7
    a.claim_deadline = 5
    assert table.next_due() == 5
    assert table.unclaimed_due(now=6) == [a]  # handled once: its claim window no longer falls due
    assert table.next_due() == 7


# ---------------------------------------------------------------------------- protocol across processes


@pytest.fixture()
def runtime(tmp_path: Path) -> Iterator[Path]:
    d = Path(os.environ.get("XDG_RUNTIME_DIR", "/tmp")) / f"bf-tmq-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir(mode=0o700)
    ensure_tensormq(d)
    yield d
    for p in Path("/dev/shm").glob(f"blockflow-tmq-{d.name}-*"):
        p.unlink()


def _producer_proc(runtime: str, name: str, conn: mp.connection.Connection, lease_s: float) -> None:
    """Serves batches on request ("batch"), so leases start when the test is ready."""
    prod = Producer(name, Path(runtime), CPU, pool_bytes=1 << 20, max_slots=8, lease_s=lease_s, wait_s=0.5)
    b = 0
    while conn.recv() == "batch":
        r = prod.reserve((3, 4, 5), torch.float32)
        r.view.copy_(torch.arange(60, dtype=torch.float32).view(3, 4, 5) + 100 * b)
        conn.send(prod.commit(r, 0))
        b += 1
    prod.close()


def _stats(runtime: Path, pid: int) -> dict[str, int]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    (gen,) = generations(runtime, pid)
    sock.connect(endpoint(runtime, pid, gen))
    sock.send_multipart([STATS])
    assert sock.poll(5000)
    _, body = sock.recv_multipart()
    sock.close(0)
    data: dict[str, int] = json.loads(body)
    return data


def _tickets(raw: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(raw)), dtype=torch.uint8).view(len(raw), 256)


@pytest.mark.parametrize("release", ["table", "message"])
def test_consumer_maps_each_producer_segment_once_and_reads_exact_values(runtime: Path, release: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact values, zero-copy views, one handshake; every sample comes back, through the claim table
    (the default) or as ZeroMQ RELEASE messages (``BLOCKFLOW_TMQ_RELEASE=message``)."""
    monkeypatch.setenv(env.TMQ_RELEASE, release)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer_proc, args=(str(runtime), "blockA/0", there, 30.0))
    proc.start()
    consumer = Consumer(runtime, CPU)
    try:
        for b in range(6):
            here.send("batch")
            tickets = here.recv()
            # A block reads its tickets into a NumPy array (numpy.from_dlpack); a torch tensor works too.
            raw = _tickets(tickets) if b % 2 else np.frombuffer(b"".join(tickets), dtype=np.uint8).reshape(-1, 256)
            x, releases = consumer.gather(raw, (4, 5), stream=0)
            assert torch.equal(x, torch.arange(60, dtype=torch.float32).view(3, 4, 5) + 100 * b)
            assert len(releases) == 3 and x.data_ptr() == consumer._remotes[(t0 := tk.decode(tickets[0], consumer.key)).producer, t0.generation].segment.tensor.data_ptr() + t0.offset  # a zero-copy view
            consumer.release_now(releases)
        consumer.flush()
        assert consumer.stats.handle_opens == 1 and consumer.stats.hellos == 1  # once per segment, not per request
        from blockflow.backend.tensormq.reservation import producer_id

        deadline = time.monotonic() + 5
        while _stats(runtime, producer_id("blockA/0"))["slots_in_use"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = _stats(runtime, producer_id("blockA/0"))
        assert stats["slots_in_use"] == 0 and stats["releases"] == 18 and stats["lease_expiries"] == 0
    finally:
        here.send("stop")
        proc.join(10)
        consumer.close()


def _consume_and_die(runtime: str, conn: mp.connection.Connection) -> None:
    consumer = Consumer(Path(runtime), CPU)
    conn.send("ready")
    consumer.gather(_tickets(conn.recv()), (4, 5), stream=0)
    conn.send("read")
    time.sleep(60)  # killed before it releases anything


def test_killed_consumer_slots_come_back_within_the_lease(runtime: Path) -> None:
    from blockflow.backend.tensormq.reservation import producer_id

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer_proc, args=(str(runtime), "blockB/0", there, 2.0))
    proc.start()
    mine, theirs = ctx.Pipe()
    victim = ctx.Process(target=_consume_and_die, args=(str(runtime), theirs))
    victim.start()
    try:
        assert mine.poll(60) and mine.recv() == "ready"
        tickets = []
        for _ in range(2):
            here.send("batch")
            tickets += here.recv()
        mine.send(tickets)
        assert mine.poll(10) and mine.recv() == "read"
        assert _stats(runtime, producer_id("blockB/0"))["slots_in_use"] == 2
        os.kill(victim.pid or 0, signal.SIGKILL)
        victim.join()
        time.sleep(2.5)  # lease 2 s
        stats = _stats(runtime, producer_id("blockB/0"))
        assert stats["slots_in_use"] == 0 and stats["lease_expiries"] == 2 and stats["bytes_in_use"] == 0
    finally:
        here.send("stop")
        proc.join(10)
        if victim.is_alive():
            victim.kill()


def test_full_pool_waits_then_fails_clearly(runtime: Path) -> None:
    prod = Producer("blockC/0", runtime, CPU, pool_bytes=2 * ALIGN, max_slots=4, lease_s=30, wait_s=0.3)
    try:
        prod.reserve((1, 2 * ALIGN // 4), torch.float32)
        start = time.monotonic()
        with pytest.raises(PoolExhaustedError, match="pool of blockC/0 is full .* after waiting 0.3 s"):
            prod.reserve((1, 8), torch.float32)
        assert 0.25 <= time.monotonic() - start < 5
        assert prod.stats.pool_failures == 1
    finally:
        prod.close()


def test_a_read_that_fails_after_its_claims_releases_them(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A good ticket whose read fails for another reason (a CUDA error, say) gives its claim back at
    once: the producer's only slot is free again long before its lease."""
    prod = Producer("blockR/0", runtime, CPU, pool_bytes=1 << 20, max_slots=1, lease_s=30, wait_s=2, prepare=False)
    consumer = Consumer(runtime, CPU)
    try:
        tickets = prod.commit(prod.reserve((2, 8), torch.float32), 0)

        def broken(*_: object) -> torch.Tensor:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        with monkeypatch.context() as m:
            m.setattr(consumer, "_view", broken)
            with pytest.raises(RuntimeError, match="illegal memory access"):
                consumer.gather(_tickets(tickets), (8,), 0)
        consumer.flush()
        assert consumer.stats.bad_tickets == 0  # not the caller's fault
        r = prod.reserve((1, 8), torch.float32)  # the one slot: freed by the release, not the 30-s lease
        with pytest.raises(TicketError, match="no tickets"):
            consumer.gather(torch.zeros((0, tk.TICKET_BYTES), dtype=torch.uint8), (8,), 0)

        # A failed wait for the GPU (a sticky CUDA error) neither stops the release thread nor keeps the slot.
        tickets = prod.commit(r, 0)
        _, releases = consumer.gather(_tickets(tickets), (8,), 0)

        def failed_wait(_: int) -> None:
            raise BlockError("cuEventSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        monkeypatch.setattr(cuda, "event_synchronize", failed_wait)
        consumer.release_after(releases, None, after=1)
        consumer.flush()
        prod.reserve((1, 8), torch.float32)
    finally:
        consumer.close()
        prod.close()


def test_an_idle_producer_sleeps_until_a_slot_falls_due_and_close_wakes_it(runtime: Path) -> None:
    """The server thread naps a tenth of the claim window (here 60 s) when nothing falls due sooner,
    instead of going round every 100 ms (each round takes the stub's GIL); close() wakes it."""
    prod = Producer("blockS/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=600, wait_s=1, prepare=False)
    rounds: list[float] = []
    due = prod.table.next_due
    prod.table.next_due = lambda: rounds.append(time.monotonic()) or due()  # type: ignore[method-assign]
    time.sleep(0.6)
    prod.close()
    assert len(rounds) <= 2 and not prod._thread.is_alive()  # asleep throughout, then woken at once
    prod.close()  # a second close (a finalize after a failed initialize, a test's cleanup) does nothing


def test_a_lease_that_ends_while_the_server_thread_naps_is_reaped(runtime: Path) -> None:
    """A slot reserved while the thread naps (0.1 s, with nothing live) and never committed (its
    call died) is still reaped when its lease ends. Never committed: a committed slot nobody claims
    may be given back at its claim window's end first, which here ends with the lease."""
    prod = Producer("blockT/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=1.0, wait_s=1, prepare=False)
    try:
        time.sleep(0.15)
        prod.reserve((1, 8), torch.float32)
        deadline = time.monotonic() + 10
        while prod.stats.lease_expiries == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert prod.stats.lease_expiries == 1 and not prod.table.live
    finally:
        prod.close()


def _wait_ready(prod: Producer, want: bool = True) -> None:
    deadline = time.monotonic() + 5
    while (prod._ready is not None) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (prod._ready is not None) == want


def test_a_batch_of_one_is_followed_by_a_prepared_reservation_that_reads_exactly(runtime: Path) -> None:
    """After a call of batch 1, the next batch-1 reservation is made and signed between calls; the
    call takes it and its tickets read, claim and release like any other. The prepared slot is
    not in use (stats, usage), and a batch of another size leaves it alone. Its tickets come packed
    as the block packs them (``pack``), by the preparer too."""
    from blockflow.backend.tensormq.reservation import producer_id

    prod = Producer("blockP/0", runtime, CPU, pool_bytes=1 << 20, max_slots=8, lease_s=30, wait_s=1,
                    pack=lambda tickets: ("packed", tuple(tickets)))
    consumer = Consumer(runtime, CPU)
    try:
        for b in range(4):
            r = prod.reserve((1, 4, 5), torch.float32)
            assert (r.tickets is not None) == (b > 0)  # the first call had nothing prepared
            r.view.copy_(torch.arange(20, dtype=torch.float32).view(1, 4, 5) + 100 * b)
            tickets = prod.commit(r, 0)
            assert r.packed == (("packed", tuple(tickets)) if b > 0 else None)
            prod.prepare_ahead()
            _wait_ready(prod)
            stats = _stats(runtime, producer_id("blockP/0"))
            assert stats["slots_in_use"] == 1 and stats["slots_ready"] == 1 and prod.usage() == (ALIGN, 1)
            x, releases = consumer.gather(_tickets(tickets), (4, 5), stream=0)
            assert torch.equal(x, torch.arange(20, dtype=torch.float32).view(1, 4, 5) + 100 * b)
            with pytest.raises(TicketError, match="already accepted"):  # pre-signed tickets are one-shot too
                consumer.gather(_tickets(tickets), (4, 5), stream=0)
            consumer.release_now(releases)
            consumer.flush()
            deadline = time.monotonic() + 5
            while prod.usage()[1] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert prod.usage() == (0, 0)
        two = prod.reserve((2, 4, 5), torch.float32)
        assert two.tickets is None and prod._ready is not None  # another shape: made on the spot
        prod.commit(two, 0)
        prod.prepare_ahead()  # after a batch of 2: nothing new to prepare, the batch-1 slot stays
        assert prod.reserve((1, 4, 5), torch.float32).tickets is not None
        assert prod.stats.allocations == 6 and prod.stats.lease_expiries == 0
    finally:
        consumer.close()
        prod.close()


def test_a_prepared_slot_never_makes_a_request_wait_or_an_unload_drain(runtime: Path) -> None:
    prod = Producer("blockQ/0", runtime, CPU, pool_bytes=4 * ALIGN, max_slots=4, lease_s=30, wait_s=0.3)
    try:
        prod.commit(prod.reserve((1, 8), torch.float32), 0)
        prod.prepare_ahead()
        _wait_ready(prod)
        # Three slots are left and the prepared one holds one: a request for all three still gets them at once.
        start = time.monotonic()
        prod.reserve((1, 3 * ALIGN // 4), torch.float32)
        assert time.monotonic() - start < 0.2 and prod._ready is None and prod.stats.pool_waits == 0
        # A pool at least half full prepares nothing.
        prod.prepare_ahead()
        time.sleep(0.2)
        assert prod._ready is None
    finally:
        prod.close()
    idle = Producer("blockR/0", runtime, CPU, pool_bytes=1 << 16, max_slots=8, lease_s=30, wait_s=1)
    idle.commit(idle.reserve((1, 8), torch.float32), 0)
    idle.abort(idle.reserve((2, 8), torch.float32))
    idle.table.release_all(0, idle.table.live[0].seq)  # the committed batch came back
    idle.prepare_ahead()
    _wait_ready(idle)
    start = time.monotonic()
    assert idle.drain(5) == 0 and time.monotonic() - start < 1  # the prepared slot is not waited for
    idle.close(drain_s=5)


def _pool_then_wait(runtime: str, name: str, conn: mp.connection.Connection) -> None:
    prod = Producer(name, Path(runtime), CPU, pool_bytes=1 << 20, max_slots=4, lease_s=30, wait_s=1)
    conn.send(env.pool_shm_name(Path(runtime), prod.id, prod.generation))
    time.sleep(60)  # SIGKILLed before it closes anything


def test_a_restarted_producer_frees_the_host_pool_of_a_killed_one(runtime: Path) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    victim = ctx.Process(target=_pool_then_wait, args=(str(runtime), "blockK/0", child))
    victim.start()
    try:
        killed = SHM_DIR / parent.recv()
        assert killed.exists()
    finally:
        os.kill(victim.pid or 0, signal.SIGKILL)
        victim.join()
    assert killed.exists()  # nobody freed it yet
    other = Producer("blockL/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=30, wait_s=1)
    assert killed.exists()  # another block's restart leaves it (it cannot tell a slow start from a dead one)
    again = Producer("blockK/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=30, wait_s=1)
    try:
        assert not killed.exists()
        assert (SHM_DIR / env.pool_shm_name(runtime, again.id, again.generation)).exists()
    finally:
        again.close()
        other.close()
    assert not (SHM_DIR / env.pool_shm_name(runtime, again.id, again.generation)).exists()


def test_restarted_producer_refuses_old_tickets(runtime: Path) -> None:
    first = Producer("blockD/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=30, wait_s=1)
    r = first.reserve((1, 4, 5), torch.float32)
    r.view.fill_(1)
    old = first.commit(r, 0)
    first.close()
    consumer = Consumer(runtime, CPU, hello_timeout_s=2)
    try:
        with pytest.raises(TicketError, match="not running"):
            consumer.gather(_tickets(old), (4, 5), 0)
        second = Producer("blockD/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=30, wait_s=1)
        try:
            with pytest.raises(TicketError, match="stale ticket: producer .* is not running"):
                consumer.gather(_tickets(old), (4, 5), 0)
            r2 = second.reserve((1, 4, 5), torch.float32)
            r2.view.fill_(2)
            x, rel = consumer.gather(_tickets(second.commit(r2, 0)), (4, 5), 0)
            assert torch.equal(x, torch.full((1, 4, 5), 2.0))
        finally:
            second.close()
    finally:
        consumer.close()


def test_signed_but_out_of_bounds_or_misshaped_tickets_fail_alone(runtime: Path) -> None:
    prod = Producer("blockE/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=30, wait_s=1, claim_s=0.5)
    consumer = Consumer(runtime, CPU)
    key = (runtime / "tmq.key").read_bytes()
    try:
        r = prod.reserve((2, 4, 5), torch.float32)
        good = prod.commit(r, 0)
        t = tk.decode(good[0], key)
        beyond = tk.encode(t._replace(offset=(1 << 16) - 40), key)
        with pytest.raises(TicketError, match="outside producer"):
            consumer.gather(_tickets([good[1], beyond]), (4, 5), 0)
        with pytest.raises(TicketError, match="this block takes"):
            consumer.gather(_tickets([good[0]]), (5, 4), 0)
        with pytest.raises(TicketError, match="uint8"):
            consumer.gather(torch.zeros(1, 255, dtype=torch.uint8), (4, 5), 0)
        with pytest.raises(TicketError, match="uint8"):
            consumer.gather(np.zeros((1, 128), dtype=np.uint16), (4, 5), 0)
        with pytest.raises(TicketError, match="uint8"):
            consumer.gather(np.zeros(256, dtype=np.uint8), (4, 5), 0)
        consumer.flush()
        time.sleep(0.2)
        # The claimed ticket of the failed request was released; the misshaped one was never
        # accepted, so its sample goes back when the claim window closes (not at the lease's end).
        assert prod.usage()[1] == 1
        time.sleep(0.6)
        assert prod.usage()[1] == 0 and prod.stats.unclaimed_tickets == 1 and prod.stats.lease_expiries == 0
        assert prod.stats.releases == 1  # counted when the slot is freed
    finally:
        consumer.close()
        prod.close()


def test_a_block_also_accepts_the_feeders_its_file_names_until_then(runtime: Path, tmp_path: Path) -> None:
    """During a live plan change a reloaded block also takes its old (or new) feeders' tickets, as long
    as the file apply writes beside its config says (blockflow.core.also_accepts); before and after
    that, and with a file it cannot parse, they are redirected tickets."""
    prod = Producer("trunk/trunk_0_0", runtime, CPU, pool_bytes=1 << 16, max_slots=2, lease_s=30, wait_s=1,
                    model="trunk", max_samples=8)
    model_dir = tmp_path / "head"
    model_dir.mkdir()
    consumer = Consumer(runtime, CPU, accepts_from=["not_trunk"], also_accepts=model_dir / also_accepts.FILE)

    def committed() -> list[bytes]:
        r = prod.reserve((1, 4, 5), torch.float32)
        r.view.fill_(1.0)
        return prod.commit(r, 0)

    try:
        first = committed()
        for contents in (None, b"{not json", b'{"models": ["trunk"], "until": 1e12, "more": 1}'):
            if contents is not None:
                (model_dir / also_accepts.FILE).write_bytes(contents)
            with pytest.raises(TicketError, match="redirected ticket"):
                consumer.gather(_tickets(first), (4, 5), 0)
        also_accepts.write(model_dir, also_accepts.AlsoAccepts(models=("other", "trunk"), until=time.time() + 30))
        x, rel = consumer.gather(_tickets(first), (4, 5), 0)  # the refusals did not use the ticket up
        assert torch.equal(x, torch.ones(1, 4, 5))
        consumer.release_now(rel)
        also_accepts.write(model_dir, also_accepts.AlsoAccepts(models=("trunk",), until=time.time() - 1))
        with pytest.raises(TicketError, match="redirected ticket"):
            consumer.gather(_tickets(committed()), (4, 5), 0)
        assert consumer.stats.refused_tickets == 4
    finally:
        consumer.close()
        prod.close()


def test_tickets_are_one_shot_and_bound_to_their_hop(runtime: Path) -> None:
    """A ticket is accepted once, by a block its producer feeds, within its claim window: a replay
    (to the same or another consumer), a redirect, a ticket of a reused slot or an expired one is
    refused before anything is read, and a refused copy never frees its rightful reader's slot."""
    prod = Producer("trunk/trunk_0_0", runtime, CPU, pool_bytes=1 << 16, max_slots=2, lease_s=30, wait_s=1,
                    model="trunk", max_samples=8, claim_s=0.4)
    first = Consumer(runtime, CPU, accepts_from=["trunk"])
    second = Consumer(runtime, CPU, accepts_from=["trunk", "other"])
    elsewhere = Consumer(runtime, CPU, accepts_from=["not_trunk"])
    try:
        r = prod.reserve((2, 4, 5), torch.float32)
        r.view.copy_(torch.arange(40, dtype=torch.float32).view(2, 4, 5))
        tickets = prod.commit(r, 0)
        with pytest.raises(TicketError, match="redirected ticket: .* takes tickets from not_trunk"):
            elsewhere.gather(_tickets(tickets), (4, 5), 0)
        x, rel = first.gather(_tickets(tickets), (4, 5), 0)  # the redirect did not use the ticket up
        assert torch.equal(x, torch.arange(40, dtype=torch.float32).view(2, 4, 5))
        for consumer in (first, second):
            with pytest.raises(TicketError, match="replayed ticket: it was already accepted once"):
                consumer.gather(_tickets(tickets[1:]), (4, 5), 0)
            consumer.flush()
        assert prod.usage()[1] == 1  # refused copies released nothing
        first.release_now(rel)
        first.flush()
        deadline = time.monotonic() + 5
        while prod.usage()[1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert prod.usage()[1] == 0
        r2 = prod.reserve((1, 4, 5), torch.float32)  # the same slot, its next use
        assert r2.slot.index == r.slot.index
        fresh = prod.commit(r2, 0)
        with pytest.raises(TicketError, match="replayed or stale ticket: its pool slot has been reused"):
            second.gather(_tickets(tickets[:1]), (4, 5), 0)
        time.sleep(0.5)
        with pytest.raises(TicketError, match="expired ticket"):
            second.gather(_tickets(fresh), (4, 5), 0)
        assert first.stats.refused_tickets + second.stats.refused_tickets + elsewhere.stats.refused_tickets == 5
    finally:
        for c in (first, second, elsewhere):
            c.close()
        prod.close()


def _claim_all(path: str, slots: int, samples: int, seq: int, result: str) -> None:
    from blockflow.backend.tensormq.claims import ClaimTable

    table = ClaimTable(Path(path))
    won = [(s, k) for s in range(slots) for k in range(samples) if table.claim(s, seq, k) is None]
    for s, k in won:  # each gives back what it won, one sample at a time: the words are shared by all
        assert table.release(s, seq, [k]) == 1
    table.close()
    Path(result).write_text(str(len(won)))


def test_a_claim_is_won_by_exactly_one_of_many_racing_processes(tmp_path: Path) -> None:
    from blockflow.backend.tensormq.claims import ClaimTable

    slots, samples = 16, 40  # two claim words per slot
    table = ClaimTable(tmp_path / "t.claims", slots, samples, create=True)
    for s in range(slots):
        table.open_slot(s, 5, time.monotonic() + 60)
    assert (tmp_path / "t.claims").stat().st_mode & 0o777 == 0o600
    ctx = mp.get_context("spawn")
    results = [tmp_path / f"won{i}" for i in range(3)]
    procs = [ctx.Process(target=_claim_all, args=(str(tmp_path / "t.claims"), slots, samples, 5, str(r))) for r in results]
    for p in procs:
        p.start()
    # A process that dies says so with its exit code (a queue would only time out).
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]  # None: still running after two minutes
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0, 0], codes
    won = [int(r.read_text()) for r in results]
    assert sum(won) == slots * samples  # every sample claimed once, by one process only
    assert all(table.claimed(s, 5) == set(range(samples)) for s in range(slots))
    # Every sample released by the process that claimed it: each slot's release words are the full target.
    assert table.release_words().tolist() == [ClaimTable.release_target(5, samples, table.words)] * slots
    assert table.claimed(0, 6) is None and table.claim(0, 6, 0) is not None  # another use of the slot
    table.close()


def test_a_hop_of_several_tensors_crosses_as_one_record_per_sample(runtime: Path) -> None:
    """A skip connection across a cut: two tensors per sample in one record, one ticket per sample;
    the consumer gets both exactly, also for samples picked out of order, and a ticket whose
    tensors differ from what the block takes is refused before anything is read."""
    prod = Producer("trunk/trunk_0_0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=30, wait_s=1,
                    model="trunk", max_samples=8)
    consumer = Consumer(runtime, CPU, accepts_from=["trunk"])
    shapes = [(2, 3), (4,)]
    try:
        r = prod.reserve_tensors(3, shapes, torch.float32)
        a, b = torch.arange(18.0).view(3, 2, 3), -torch.arange(12.0).view(3, 4)
        r.views[0].copy_(a)
        r.views[1].copy_(b)
        tickets = prod.commit(r, 0)
        assert len(tickets) == 3 and tk.decode(tickets[0], consumer.key).layout == tk.layout_id(shapes)
        with pytest.raises(TicketError, match=r"carries a record of several tensors; this block takes shape \[2, 3\]"):
            consumer.gather(_tickets(tickets), (2, 3), 0)
        with pytest.raises(TicketError, match=r"this block takes \[2, 3\] \+ \[2, 2\]"):
            consumer.gather_tensors(_tickets(tickets), [(2, 3), (2, 2)], 0)
        r2 = prod.reserve_tensors(3, shapes, torch.float32)  # the refused requests claimed nothing: read a fresh batch
        r2.views[0].copy_(a + 100)
        r2.views[1].copy_(b - 100)
        fresh = prod.commit(r2, 0)
        (x, y), rel = consumer.gather_tensors(_tickets([fresh[2], fresh[0]]), shapes, 0)
        assert torch.equal(x, (a + 100)[[2, 0]]) and torch.equal(y, (b - 100)[[2, 0]])
        consumer.release_now(rel)
    finally:
        consumer.close()
        prod.close()


def test_a_traced_hop_names_its_steps(runtime: Path) -> None:
    """The tracer's laps inside commit and gather (bench.timeline's finer steps), in the order they ran."""
    prod = Producer("blockL/0", runtime, CPU, pool_bytes=1 << 20, max_slots=4, lease_s=30, wait_s=1, prepare=False)
    consumer = Consumer(runtime, CPU)
    laps: list[str] = []
    try:
        r = prod.reserve((2, 8), torch.float32)
        tickets = prod.commit(r, 0, laps.append)
        _, releases = consumer.gather_tensors(_tickets(tickets), [(8,)], 0, laps.append)
        consumer.release_now(releases)
        assert laps == ["run:event", "read:decode", "read:claim", "read:wait"]  # the first ticket's steps only
    finally:
        consumer.close()
        prod.close()


def test_a_ticket_handed_on_before_its_commit_waits_for_it_and_reads_the_committed_data(runtime: Path) -> None:
    """Producer.issue: tickets leave before the batch is written and committed. The consumer that
    gets one waits for the commit (then reads exactly what was written); if the producer gives the
    batch up instead, every issued ticket is refused with a clear error, as is one whose commit
    never comes or whose producer stops."""
    import threading

    prod = Producer("blockE/0", runtime, CPU, pool_bytes=1 << 20, max_slots=4, lease_s=30, wait_s=1, prepare=False)
    consumer = Consumer(runtime, CPU, commit_wait_s=0.5)
    try:
        r = prod.reserve((2, 4, 5), torch.float32)
        early = prod.issue(r)
        expected = torch.arange(40, dtype=torch.float32).view(2, 4, 5)

        def write_and_commit() -> None:
            time.sleep(0.05)  # the consumer is waiting by now
            r.view.copy_(expected)
            assert prod.commit(r, 0) == early  # the same tickets
        writer = threading.Thread(target=write_and_commit)
        writer.start()
        x, releases = consumer.gather(_tickets(early), (4, 5), 0)
        writer.join()
        assert torch.equal(x, expected) and consumer.stats.commit_waits == 1
        consumer.release_now(releases)
        with pytest.raises(TicketError, match="replayed ticket"):  # one-shot as ever
            consumer.gather(_tickets(early[:1]), (4, 5), 0)

        failed = prod.reserve((1, 4, 5), torch.float32)
        lost = prod.issue(failed)
        prod.abort(failed)  # e.g. its graph replay raised after the tickets left
        with pytest.raises(ProducerGoneError, match="failed batch: the block that issued this ticket could not produce its data"):
            consumer.gather(_tickets(lost), (4, 5), 0)

        stuck = prod.reserve((1, 4, 5), torch.float32)
        start = time.monotonic()
        with pytest.raises(ProducerGoneError, match="uncommitted ticket: producer .* did not commit its batch within 0.5 s"):
            consumer.gather(_tickets(prod.issue(stuck)), (4, 5), 0)
        assert 0.5 <= time.monotonic() - start < 3
        orphan = prod.issue(prod.reserve((1, 4, 5), torch.float32))
    finally:
        prod.close()
    try:
        start = time.monotonic()
        with pytest.raises(ProducerGoneError, match="stopped before it committed the batch of this ticket"):
            consumer.gather(_tickets(orphan), (4, 5), 0)
        assert time.monotonic() - start < 0.5  # noticed by its socket, before the commit wait ends
    finally:
        consumer.close()


def test_a_claim_table_tells_a_pending_use_from_a_stale_or_failed_one(tmp_path: Path) -> None:
    from blockflow.backend.tensormq.claims import PENDING, ClaimTable

    table = ClaimTable(tmp_path / "t.claims", 2, 8, create=True)
    try:
        assert table.claim(0, 1, 0) is PENDING  # nothing committed yet: the first use is ahead
        table.open_slot(0, 7, time.monotonic() + 60)
        assert table.claim(0, 8, 0) is PENDING and table.claim(0, 9, 0) is PENDING
        assert table.claim(0, 6, 0) is not None and "stale" in str(table.claim(0, 6, 0))
        assert table.claim(0, 7, 3) is None and "replayed ticket" in str(table.claim(0, 7, 3))
        table.open_slot(1, 0xFFFFFFFF, time.monotonic() + 60)  # sequence numbers wrap
        assert table.claim(1, 0, 0) is PENDING and "stale" in str(table.claim(1, 0xFFFFFFFE, 0))
        table.fail_slot(0, 8)
        assert "failed batch" in str(table.claim(0, 8, 0)) and "stale" in str(table.claim(0, 7, 0))
    finally:
        table.close()


def test_a_consumer_releases_only_samples_it_claimed_of_the_use_the_entry_holds(tmp_path: Path) -> None:
    from blockflow.backend.tensormq.claims import ClaimTable

    table = ClaimTable(tmp_path / "t.claims", 2, 40, create=True)
    try:
        table.open_slot(0, 7, time.monotonic() + 60)
        target = ClaimTable.release_target(7, 3, table.words)
        assert table.claim(0, 7, 0) is None and table.claim(0, 7, 1) is None
        assert table.release(0, 7, [0, 2]) == 1  # sample 2 was never claimed
        assert table.release(0, 7, [0]) == 0  # a duplicated release
        assert table.release(0, 6, [1]) == 0 and table.release(0, 8, [1]) == 0  # another use
        assert table.release(0, 7, [1, 99]) == 1 and table.release(5, 7, [1]) == 0  # out of range: nothing
        assert table.release_words()[0].tolist() != target  # sample 2 still out
        # Once the window ended, the producer retires what nobody claimed: a late claim is refused as expired.
        assert table.retire_unclaimed(0, 7, [0, 1, 2]) == [2]
        assert table.release_words()[0].tolist() == target
        assert "expired" in str(table.claim(0, 7, 2, now=time.monotonic() + 120))
        assert table.retire_unclaimed(0, 6, [0]) == [] and table.retire_unclaimed(1, 7, [0]) == []
        table.open_slot(0, 8, time.monotonic() + 60)  # a new use starts with nothing released
        assert table.release_words()[0].tolist() == [8 << 32] * table.words
    finally:
        table.close()


def test_a_claim_table_entry_excludes_this_process_s_other_threads_too(tmp_path: Path) -> None:
    """Record locks belong to the process: a block's release thread must still wait for its execute
    thread's read-modify-write of the entry (else another process gets in mid-write and a bit is lost)."""
    import threading

    from blockflow.backend.tensormq.claims import ClaimTable

    mine = ClaimTable(tmp_path / "t.claims", 1, 8, create=True)
    other = ClaimTable(tmp_path / "t.claims")  # the release thread's own descriptor of the same file
    try:
        mine.open_slot(0, 3, time.monotonic() + 60)
        assert mine.claim(0, 3, 0) is None
        mine._lock(0)  # the execute thread, mid-claim
        released: list[int] = []
        t = threading.Thread(target=lambda: released.append(other.release(0, 3, [0])))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not released  # it waits for the entry
        mine._unlock(0)
        t.join(5)
        assert released == [1]
        # Closing a descriptor of the file (its mapping's too) drops the process's record locks: it waits as well.
        mine._lock(0)
        t = threading.Thread(target=other.close)
        t.start()
        t.join(0.3)
        assert t.is_alive()
        mine._unlock(0)
        t.join(5)
        assert not t.is_alive() and other.closed
        # A closed table touches no descriptor: its old number may be another file's by now.
        with pytest.raises(ValueError, match="closed"):
            other.release(0, 3, [0])
        other.close()  # a second close does nothing
    finally:
        if not other.closed:
            other.close()
        mine.close()


_HOLDS_B_WANTS_A = """
import sys, threading, time
from pathlib import Path
from blockflow.backend.tensormq.claims import ClaimTable
a, b = ClaimTable(Path(sys.argv[1])), ClaimTable(Path(sys.argv[2]))
b._lock(0)
print("held", flush=True)
said = []

def wait_for_a():
    try:
        a._lock(0)
        a._unlock(0)
        said.append("done")
    except OSError as exc:  # EDEADLK, if this wait came last
        said.append(repr(exc))

t = threading.Thread(target=wait_for_a)
t.start()
time.sleep(2.0)  # holding B's entry while t waits for A's, which the test holds
b._unlock(0)
t.join(10)
print(said[0] if said else "stuck", flush=True)
"""


def test_entries_locked_across_threads_of_two_processes_are_not_a_deadlock(tmp_path: Path) -> None:
    """A holds X and waits for Y in another thread; B holds Y and waits for X in another thread: each
    holder goes on, so nothing is stuck, but a process-wide record lock's deadlock check (``lockf``)
    refused the last wait with EDEADLK (a claim failed under load on two H200s). OFD locks wait."""
    import subprocess
    import threading

    from blockflow.backend.tensormq.claims import ClaimTable

    x, y = (ClaimTable(tmp_path / f"{n}.claims", 1, 8, create=True) for n in "xy")
    other = subprocess.Popen([sys.executable, "-c", _HOLDS_B_WANTS_A, str(x.path), str(y.path)], cwd=Path(__file__).parents[2],
                             stdout=subprocess.PIPE, text=True)
    x._lock(0)
    held = True
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        time.sleep(0.3)  # its thread now waits for x's entry
        errors: list[BaseException] = []

        def wait_for_y() -> None:
            try:
                y._lock(0)
                y._unlock(0)
            except OSError as exc:
                errors.append(exc)

        t = threading.Thread(target=wait_for_y)
        t.start()
        time.sleep(0.3)
        x._unlock(0)
        held = False
        t.join(10)
        out, _ = other.communicate(timeout=10)
        assert not errors and not t.is_alive()
        assert other.returncode == 0 and out.strip() == "done"  # (whichever wait came last, neither was refused)
    finally:
        if held:  # the child never got as far: let go, or closing x would wait for this thread's own lock
            x._unlock(0)
        other.kill()
        x.close()
        y.close()


def test_consumers_of_either_release_kind_share_a_batch_and_the_stats_count_each_sample(runtime: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One consumer sets its release bit in the claim table, another sends a RELEASE message: the slot
    is freed once both are in. A slot whose lease runs out counts what was released as released."""
    prod = Producer("blockM/0", runtime, CPU, pool_bytes=1 << 16, max_slots=4, lease_s=1.0, wait_s=1)
    monkeypatch.setenv(env.TMQ_RELEASE, "table")
    by_table = Consumer(runtime, CPU)
    monkeypatch.setenv(env.TMQ_RELEASE, "message")
    by_message = Consumer(runtime, CPU)
    try:
        r = prod.reserve((2, 4, 5), torch.float32)
        tickets = prod.commit(r, 0)
        _, first = by_table.gather(_tickets(tickets[:1]), (4, 5), 0)
        _, second = by_message.gather(_tickets(tickets[1:]), (4, 5), 0)
        by_table.release_now(first)
        by_table.flush()
        assert prod.usage()[1] == 1  # one of two
        by_message.release_now(second)
        by_message.flush()
        deadline = time.monotonic() + 5
        while prod.usage()[1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prod.usage() == (0, 0) and prod.stats.releases == 2 and prod.stats.stale_releases == 0
        by_message.release_now(second)  # the same release again: stale, frees nothing
        by_message.flush()
        # A batch of four, three released, then its lease (1 s) runs out: 3 released, 1 expired.
        r = prod.reserve((4, 4, 5), torch.float32)
        _, got = by_table.gather(_tickets(prod.commit(r, 0)), (4, 5), 0)
        by_table.release_now(got[:3])
        by_table.flush()
        time.sleep(1.3)
        assert prod.usage() == (0, 0)
        assert (prod.stats.releases, prod.stats.expired_tickets, prod.stats.lease_expiries) == (5, 1, 1)
        assert prod.stats.stale_releases == 1
    finally:
        by_table.close()
        by_message.close()
        prod.close()
