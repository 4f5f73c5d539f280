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
   execute thread writes it, on its CUDA stream. After a call of batch 1 the
   producer's preparer thread reserves the next batch-1 slot and signs its
   tickets between calls (PREPARED: no lease, not counted in use, given back
   at once when a request needs the pool or the producer drains); the next call
   of that shape takes it and its lease starts then. Its tickets stay inside
   the producer until the commit, and its claim entry still holds the slot's
   previous use until then, so none of them can be accepted early.
3. LENT — ``Producer.commit`` recorded the slot's event on that stream *after*
   the writes, then opened the slot's claim entry for this use; there is one
   ticket per sample (the slot counts one reference per ticket). The producer
   never writes a lent slot. A block may hand the tickets on *before* the
   commit (``Producer.issue``: a call of one request answers with them before
   queuing its GPU work, ``backend/replies.py``, unless it is a sender of
   hand-overs or a link: ``ModelSpec.answers_early``); until the commit, its
   consumer finds the claim entry on an earlier use and waits for it (at most
   ``COMMIT_WAIT_S``). If the writes fail, ``Producer.abort`` marks the use
   failed and its tickets are refused; a failed, never committed or orphaned
   batch fails the consumer's request as UNAVAILABLE (``ProducerGoneError``).
4. CLAIMED — ``Consumer.gather`` verifies each ticket (MAC, layout, the hop:
   the ticket's model id must be one of the blocks that feed this one; the
   fields other than slot, seq, sample and offset are checked once per distinct
   value of them, after the MAC, and remembered), maps
   the producer on first contact (HELLO → segment and event handles, opened
   once per producer generation and cached), then *claims* the ticket's sample
   in the producer's claim table (``backend/tensormq/claims.py``). Only then
   does it make its own stream wait on the slot's event (on the GPU; no host
   synchronisation, no CUDA IPC call per request) and read.
5. The consumer records an event after the work that read the slot; its release
   thread (``backend/tensormq/releases.py``) waits for that event, then *releases* the samples it claimed: it sets
   their bits in the slot's release words in the producer's claim table, under
   the entry's lock, only for claimed samples of the use the entry holds
   (``ClaimTable.release``). Nothing is sent and the producer is not woken.
   The event is the thread's own (blocking-sync, so the thread sleeps); a consumer
   that synchronised its stream releases at once. (With ``BLOCKFLOW_GPU_WAIT=spin`` a
   middle block waits on the slot event it records at its own commit instead, one
   driver call less: the driver spins a core in any wait on an interprocess event,
   its blocking-sync flag notwithstanding; ``backend/gpu_waits.py``.) (``BLOCKFLOW_TMQ_RELEASE=message``
   sends a RELEASE message per producer instead: one frame of
   ``(generation, slot, sequence, sample)`` items, whose bits the producer's server
   thread sets in the same table; so consumers of either kind may share a batch.)
6. The producer reads every lent slot's release words at once (without a lock:
   the claim table's note says why that is safe) whenever it reserves (its execute
   thread, or the preparer), reports its usage, reaps, drains or applies a RELEASE
   message; a slot whose every sample is released is FREE again and its next use
   gets a new sequence number. A full pool's ``reserve`` reads them again every
   2 ms while it waits.

A ticket is one-shot and bound to its hop. It is accepted once (the claim is
an atomic test-and-set under a record lock, shared by every instance of every
consumer block, so a replay to any of them is refused), by a block its
producer feeds (the consumer's spec lists them: ``accepts_from``; during a live
plan change also those its model directory's ``also_accepts.json`` names, until
the time it gives: ``blockflow.core.also_accepts``), within
``claim_s`` of its commit, and only while its slot still holds the use the
ticket names (the table carries the slot's sequence number). A refused ticket
is never released, so a copy cannot free a slot its rightful reader still
uses; a request whose read fails after it claimed some of its tickets (a later
one refused, a CUDA error) releases those at once, as nothing has read them yet. Samples nobody claimed by the end of the claim window (tickets that left
the ensemble: a direct call to a block, a cancelled request) are given back
by the producer then, not at the end of the lease: it marks them claimed and
released in one step under the entry's lock, so none can be claimed after.

What a sample is: the tensors that cross the cut, in the network's order. One
tensor is a row of the batch; several (a skip connection that spans the cut)
make one *record* per sample, the tensors one after another in the block's
dtype, and the ticket says so (flag RECORD and the layout id of their shapes,
which the consumer checks against the shapes it takes). A consumer reads its
views and never writes them: the pool is the producer's (read-only on the
CPU), so a stage that would change an input in place copies it first
(``blockflow.core.arch.stage_module``).

What orders what: the event is recorded before the claim entry opens, and a
ticket is accepted only once its entry is open, so a consumer that accepted a
ticket waits on that record (a ticket handed on early waits for the entry). A slot is rewritten (and its event
re-recorded) only after every reader's GPU work completed, because samples are
released only then.

Cancel, crash, restart:

- A ticket never consumed (cancelled or timed-out request, dead consumer) is
  never released; the slot's *lease* (``lease_s`` after reserve, or after a
  prepared slot was taken) reclaims it.
  A release arriving after that carries an old sequence number and is ignored.
  ``lease_s`` must stay far above a block's latency (default 30 s). The
  producer's server thread sleeps until the next lease or claim window ends,
  so a slot reserved meanwhile is reclaimed at most ``max(0.1 s, claim_s / 10)``
  late; a message or ``close()`` wakes it at once.
- A full pool makes ``reserve`` wait at most ``wait_s``, then the request fails
  with :class:`~blockflow.backend.tensormq.reservation.PoolExhaustedError`.
- A restarted producer keeps its id (derived from its model instance name) but
  draws a new *generation*, a new segment and a new socket. A ticket whose
  generation has no listening socket is refused at once ("stale ticket"); a
  consumer that maps a new generation drops its mappings of stopped ones. The
  new generation removes what killed ones of its id left: socket, claim table
  and, for a host pool, its /dev/shm segment (``blockflow serve`` also sweeps
  its runtime directory's segments when it stops).
- Reload (a plan update, ``blockflow apply``): Triton starts the new instance
  before it unloads the old one, so two generations of one producer serve at
  once, each on its own socket; consumers map both. An unloading producer
  first *drains*: it waits until every lent slot is released or its lease
  runs out (at most ``DRAIN_S`` in ``backend/model.py``), then frees its pool,
  so a ticket already on its way to the next block stays readable.
- Tickets are untrusted (a client may call a block model and get or send one):
  each carries a keyed BLAKE2b MAC (key in the runtime directory), and layout,
  dtype, shape, bounds, hop and the one-shot claim are checked; a bad ticket
  fails its request alone, and the tickets that request claimed are still
  released.

Direct hand-overs (plan option ``hand_over: direct``; ``backend/tensormq/handout.py`` the sender,
``handover.py`` the receiver and the relay, ``blockflow/plan/direct_pairs.py`` for which pairs of blocks qualify):

- A *sender* and the one block after it, the *receiver*, run in the same ensemble step: the
  ensemble gives both the ticket the sender takes as its input. For the receiver that ticket is a
  *key*: it is checked (MAC, fields, and it must come from one of the blocks whose tickets key its
  hand-overs, ``HandOver.keys_from``, or, during a live plan change, one that ``also_accepts.json``
  names as ``keys``) but never claimed; the sender claims it as any consumer.
- The sender pushes, for each sample, a hand-over (key, status, ticket; frames in ``wire.py``) to
  every instance of the receiver (Triton, not the sender, picks the instance a request goes to):
  its own ticket, sent when the tickets are issued, before the sample's GPU work (the receiver's
  consumer then waits for the commit, as for a ticket handed on early); or the reason it failed
  that sample's request. A sender does not answer the ensemble early: its receiver waits for
  the commit, which the answer's round trip would delay.
- Each receiver instance binds its own socket (``wire.hand_over_path``); senders list the
  directory again when it changes. Unless ``BLOCKFLOW_TMQ_HANDOVER_DGRAM=0``, it binds an AF_UNIX
  datagram socket beside it (``wire.hand_over_dgram_path``; ``datagrams.py``), and a sender sends a call's
  hand-overs there first, one datagram for the call, without waiting; a call whose datagram does
  not go (the instance's queue is full, or it has none) goes over ZeroMQ. An instance keeps the
  first copy of a key's hand-over it hears and drops later ones. An instance keeps what it was not asked for
  until the claim window ends (its tickets are refused by then), and so long the keys it served.
- The receiver refuses a key it has served (a replay), waits for a key's hand-over at most
  ``COMMIT_WAIT_S``, and then reads the sender's ticket as its input, with every check above (MAC,
  hop, one-shot claim). A sender hands over as soon as it has its input, so once a key's claim
  window has ended (and ``LATE_S`` more) or its producer stopped, the hand-over came long ago or
  never will: after ``LOOK_AFTER_S`` of waiting, and every ``LOOK_EVERY_S``, the receiver reads
  the key's entry in its producer's claim table (claiming nothing) and fails such a key at once.
  That is how a key replayed after its served entry was forgotten fails. A slot reused since says
  nothing by itself: the run's first sender released the key's sample, and a later receiver of
  the run still waits for its own sender; the slot's current use ends its window later, so once
  that one has ended too, the key's has. A key still in its window that never reached the sender (a client took it
  from the first block and sent it to the receiver itself) waits out ``COMMIT_WAIT_S``; the
  requests of one call share that wait (``Relay.begin``), so such keys hold a call once, however
  many of its requests carry them. A sender's own ticket that reaches it through the ensemble (an ensemble
  from before a live plan change) is read as it is.
- A forged or replayed key, a hand-over that does not come, a sender's failure: each fails the one
  request (400 for a bad key, UNAVAILABLE for the rest).
- The block after a run of hand-overs (the *join*) takes the senders' tickets as optional inputs
  ``HANDED_AFTER_<k>`` and never reads them: Triton runs only the steps whose outputs some step
  takes (``docs/triton-notes.md``).

Chains (plan option ``hand_over: chain``; ``backend/link_loop.py``, ``direct_pairs.chain_roles``):

- The receivers of the qualifying pairs are *links*: no ensemble steps. A run ``h -> r1 ... rk -> j``
  has its *head* ``h`` (a step) hand over each sample keyed by the ticket it hands over (its MAC), and
  the ensemble gives that ticket to the *join* ``j`` (the step after ``h``) as its key.
- A sender whose receiver is a link sends each call's hand-overs to one instance of it, the next
  call's to the next (one datagram that does not go is tried on the next instance; otherwise the rest
  goes over ZeroMQ to the first instance still listening): two instances must never take one sample,
  or the second's refused claim would be handed on as its failure.
- A link instance takes what it hears on a thread of its own (``HandIn.take_any``; each key once,
  at most ``max_batch_size`` samples a batch), claims the tickets as any consumer (the samples of one
  slot use together, so one bad use fails only its samples; a batch of several uses is joined into
  one tensor, a copy), runs them into its own slot and hands its tickets on under the same keys before
  queuing the GPU work. A failure it was handed, one of its own, and a hand-over that waited longer
  than the join waits (``COMMIT_WAIT_S``) are handed on as the sample's failure, so the join's request
  fails with it (UNAVAILABLE); every sample a link takes is handed on, failed or (the tail) answered
  exactly once, whatever of its batch fails and wherever. A link answers no request (a direct call fails with a clear error);
  Triton's statistics do not count its work.
- With ``chain_answers: head`` a chain that runs to its tasks' last block has no join: that block is a
  link too, the *tail*. The head's hand-overs name its instance (their *origin*, its pid); the tail
  sends each sample's answer, or the failure it was handed, to that instance's answer socket
  (``wire.py``; ``answers.py``). The head registers its call's keys before it hands them over, waits
  in ``execute`` until each request has every answer, a failure, or nothing after the lease's wait,
  and returns the responses (``backend/chain_answers.py``); a call whose hand-overs reach no instance
  of its first link fails at once (UNAVAILABLE). An instance runs one call at a time, so an answer
  for no key of its current call is dropped (what waits on its socket when a call begins, at once).
  The tail has a socket per head instance: an unread datagram counts against its sender's buffer.
- A link that stops (an unload, a reload) first removes its sockets' files, so senders stop finding it,
  then runs what reached it until it hears nothing for two polls.
- The join resolves its key as a receiver of direct hand-overs, but never asks the key's claim table:
  the head's ticket was claimed hops before the last link hands over, so its window and its producer's
  life say nothing of that hand-over; a key that gets none fails after the wait. A key whose request
  was cancelled leaves its samples to the claim windows, as a ticket that left the ensemble. Calling
  the head directly runs every link of its chain (its last link's slot is then held until its claim
  window ends), as calling each block in turn would.
- A block's part in a chain cannot change on a running server (``blockflow apply`` refuses it and
  changes nothing).

Messages: everything on these sockets (consumer to producer: HELLO, STATS, and RELEASE where messages release; sender to
receiver: the hand-overs), frame by frame, is in ``backend/tensormq/wire.py``.

The ticket (256 bytes, inside Triton's tensors and inside hand-overs) is laid out in
``backend/tensormq/ticket.py``; the claim table's layout in ``backend/tensormq/claims.py``.

Nothing on any socket is pickled. Files (named in ``blockflow/core/env.py``, the receivers'
sockets in ``wire.py``): in the runtime
directory ``$BLOCKFLOW_RUNTIME_DIR``, ``tmq.key`` (ticket MAC key, 0600) and
``tmq/<id>-<generation>.sock`` and ``.claims`` (one pair per producer generation), and
``tmq/ho<model id>-<pid>.sock`` (one per receiver instance of direct hand-overs); host pools
are ``/dev/shm/blockflow-tmq-<runtime dir>-<id>-<generation>``.
"""
