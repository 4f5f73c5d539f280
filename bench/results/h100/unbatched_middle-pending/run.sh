#!/usr/bin/env bash
# Blocks after the first without Triton's dynamic batcher, against all four with it, in turns (fp16, host inputs).
# With dynamic batching a request that reaches a block is queued and Triton's batcher thread is woken to
# form the batch and hand it to the instance thread; without it the thread that finished the previous
# ensemble step enqueues it straight for the instance (core src/dynamic_batch_scheduler.cc, Enqueue: the
# `!dynamic_batching_enabled_` branch). One thread wake-up fewer per hop: ~0.05 ms per ensemble step in
# bench/results/h100/ensemble_floor-2026-11-24-f953182/ (with the batcher against without).
# Expected: the split's c1 p50 ~0.15 ms lower (three hops), the hop ~0.05 ms lower. At c32 b1..b3 run one
# request per execute (batches of 3-5 with the batcher), each answered early with prepared slots: they may
# cost more per request and lower throughput, or not, as a call of one request does the least host work.
# The first block keeps its batcher (at c32 it joins ~7 host images per execute) and so does the unsplit graph.
#   bash run.sh COMMIT [VALUES]     (VALUES e.g. b,u in one call, u,b in the next; ~4.5 min per pair)
set -uo pipefail
source scripts/gpu_env.sh
export BLOCKFLOW_COMMIT="$1"; VALUES="${2:-b,u}"
OUT_TURNS="/tmp/turns_unbatched_$(echo "$VALUES" | tr ',' '_')"   # a fresh --out per call (turns resumes from one)
sed -e 's/^compare:.*/compare: []/' -e 's/^references:.*/references: [graph]/' plans/bench_r50.yaml > /tmp/r50_b.yaml
sed -E 's/^  (b[123]): \{(.*)\}$/  \1: {\2, dynamic_batching: false}/' /tmp/r50_b.yaml > /tmp/r50_u.yaml
[ "$(grep -c 'dynamic_batching: false' /tmp/r50_u.yaml)" = 3 ] || { echo "the b1..b3 lines of plans/bench_r50.yaml changed: fix the sed"; exit 2; }
PLANS=$(echo "$VALUES" | sed -e 's#\bb\b#/tmp/r50_b.yaml#g' -e 's#\bu\b#/tmp/r50_u.yaml#g')
python3 -m blockflow.bench.turns --option=--plan --values "$PLANS" --row fp16_host --out "$OUT_TURNS" --turn-s 135 2>&1 \
  | grep -E "^\[turns\]|^\| |^- |Traceback|Error" | tail -30
mkdir -p $OUT/fp16_host; cp "$OUT_TURNS"/turns.md $OUT/fp16_host/
for d in "$OUT_TURNS"/*_*/; do cp ${d}fp16_host/results.json $OUT/fp16_host/$(basename $d).json 2>/dev/null; done
