"""TensorMQ: activations stay in the producer's memory; a 256-byte ticket crosses the ensemble.

The protocol's rules (this note is where they live)
==================================================

Parties. A *producer* is a block instance whose output goes to the next block;
a *consumer* is the instance that reads it. Each block instance of a
``tensormq`` plan is both (except at the task's ends). The producer owns one
*pool segment* (CUDA memory from ``cuMemAlloc`` on a GPU, a ``/dev/shm`` file on
the CPU) split into *slots*, one interprocess CUDA *event* per slot, and a
ZeroMQ ROUTER socket at ``ipc://$BLOCKFLOW_RUNTIME_DIR/tmq/<producer id>-<generation>.sock``
(the runtime directory is 0700: only the server's user can reach it).

Who owns a slot when:

1. FREE — in the producer's table.
2. RESERVED — ``Producer.reserve`` took it for one batch; only the producer's
   execute thread writes it, on its CUDA stream.
3. LENT — ``Producer.commit`` recorded the slot's event on that stream *after*
   the writes, then issued one ticket per sample (the slot counts one reference
   per ticket). The producer never writes a lent slot.
4. Consumers read: ``Consumer.gather`` verifies each ticket, maps the producer on
   first contact (HELLO → segment and event handles, opened once per producer
   generation and cached), makes its own stream wait on the slot's event (on
   the GPU; no host synchronisation, no CUDA IPC call per request) and reads.
5. The consumer records an event after the work that read the slot; its release
   thread waits for that event, then sends RELEASE(generation, slot, sequence,
   count) — asynchronous, batched per producer.
6. The producer drops ``count`` references; at zero the slot is FREE again and
   its next use gets a new sequence number.

What orders what: the event is recorded before the ticket exists, so a consumer
that holds the ticket waits on that record. A slot is rewritten (and its event
re-recorded) only after every reader's GPU work completed, because releases are
sent only then.

Cancel, crash, restart:

- A ticket never consumed (cancelled or timed-out request, dead consumer) is
  never released; the slot's *lease* (``lease_s`` after reserve) reclaims it.
  A release arriving after that carries an old sequence number and is ignored.
  ``lease_s`` must stay far above a block's latency (default 30 s).
- A full pool makes ``reserve`` wait at most ``wait_s``, then the request fails
  with :class:`~backend.tensormq.producer.PoolExhaustedError`.
- A restarted producer keeps its id (derived from its model instance name) but
  draws a new *generation*, a new segment and a new socket. A ticket whose
  generation has no listening socket is refused at once ("stale ticket"); a
  consumer that maps a new generation drops its mappings of stopped ones.
- Reload (a plan update, ``blockflow apply``): Triton starts the new instance
  before it unloads the old one, so two generations of one producer serve at
  once, each on its own socket; consumers map both. An unloading producer
  first *drains*: it waits until every lent slot is released or its lease
  runs out (at most ``DRAIN_S`` in ``backend/model.py``), then frees its pool,
  so a ticket already on its way to the next block stays readable.
- Tickets are untrusted (a client may send one straight to a block model): each
  carries a keyed BLAKE2b MAC (key in the runtime directory), and layout, dtype,
  shape and bounds are checked; a bad ticket fails its request alone, and the
  valid tickets of that request are still released.

Nothing on any socket is pickled: HELLO answers and STATS are JSON, RELEASE is
fixed-size little-endian structs.
"""
