#!/usr/bin/env bash
# Direct hand-overs as AF_UNIX datagrams, off and on in turns (one H200). From the repository root,
# after `source scripts/gpu_env.sh`: bash bench/results/h200/handover_dgram_ab-2026-11-29*/run.sh OUT
set -u
OUT=${1:?output directory}
W=/tmp/dgram; mkdir -p "$W" "$OUT"
# bench_r50_graph.yaml (the split and its unsplit CUDA graph, nothing else) with direct hand-overs.
sed -e 's/^name: .*/name: bench-r50-graph-direct/' plans/bench_r50_graph.yaml > "$W/plan.yaml"
echo 'hand_over: direct' >> "$W/plan.yaml"
cp "$W/plan.yaml" "$OUT/plan.yaml"
# A turn (server start, then c1 and c32, 2 runs of 1 s each) takes about 100-120 s.
timeout 430 python3 -m blockflow.bench.lab.turns --env BLOCKFLOW_TMQ_HANDOVER_DGRAM --values 0,1,0,1 \
  --row fp16_host --plan "$W/plan.yaml" --out "$W/turns" --turn-s 140 --repeats 2 \
  --also="--no-gpu-alone" > "$OUT/turns.log" 2>&1
cp "$W/turns/turns.md" "$OUT/" 2>/dev/null
tar -C "$W" -czf "$OUT/turns.tgz" --exclude='*.log' turns 2>/dev/null
# Correctness: every concurrent request gets its own outputs with datagrams on (the stress check
# compares with the eager reference, so this plan serves it too).
sed -e 's/^references: .*/references: [eager, graph]/' "$W/plan.yaml" > "$W/plan_ref.yaml"
BLOCKFLOW_TMQ_HANDOVER_DGRAM=1 timeout 130 python3 -m blockflow.bench.stress --plan "$W/plan_ref.yaml" \
  --jobs 200 --workers 24 --rounds 1 --input host,cuda > "$OUT/stress_dgram.txt" 2>&1
echo "stress rc=$?" >> "$OUT/stress_dgram.txt"
