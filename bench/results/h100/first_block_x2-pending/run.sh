#!/usr/bin/env bash
# The first block in two instances against one, in turns (fp16, host inputs, no warm cores).
# At c32 with host inputs the split's first block is its bottleneck: it pays the unsplit model's per-request
# input path (Triton copying each 602 KB image into the stub's shared memory, the join, the DMA) with ~0.5 ms
# of Triton compute per request against 0.32-0.46 ms for the others (like_for_like-2026-11-27-2463fce).
# The split can replicate that block for the memory of stage 0 alone, where the unsplit model would need a
# whole second copy; the reference keeps one instance in both plans, so the c32 ratio is at equal model count,
# not equal memory (report.md's memory table gives both).
# Expected: the split's c32 up toward the next block's bound (~2400/s at 2463fce's per-request compute), c1 unchanged.
#   bash run.sh COMMIT [VALUES]     (VALUES e.g. x1,x2 in one call, x2,x1 in the next; ~4.5 min per pair)
#   then rename this folder to first_block_x2-DATE-COMMIT with the results and a README.
set -uo pipefail
source scripts/gpu_env.sh
export BLOCKFLOW_COMMIT="$1"; VALUES="${2:-x1,x2}"
sed -e 's/^compare:.*/compare: []/' -e 's/^references:.*/references: [graph]/' plans/bench_r50.yaml > /tmp/r50_x1.yaml
sed -e 's/^  b0: {model: r50, stages: 0,/  b0: {model: r50, stages: 0, instances: 2,/' /tmp/r50_x1.yaml > /tmp/r50_x2.yaml
grep -q "instances: 2" /tmp/r50_x2.yaml || { echo "the b0 line of plans/bench_r50.yaml changed: fix the sed"; exit 2; }
PLANS=$(echo "$VALUES" | sed -e 's#x1#/tmp/r50_x1.yaml#g' -e 's#x2#/tmp/r50_x2.yaml#g')
python3 -m blockflow.bench.turns --option=--plan --values "$PLANS" --row fp16_host --out /tmp/turns --turn-s 135 2>&1 \
  | grep -E "^\[turns\]|^\| |^- |Traceback|Error" | tail -30
mkdir -p $OUT/fp16_host; cp /tmp/turns/turns.md $OUT/fp16_host/
for d in /tmp/turns/*_*/; do cp ${d}fp16_host/results.json $OUT/fp16_host/$(basename $d).json 2>/dev/null; done
