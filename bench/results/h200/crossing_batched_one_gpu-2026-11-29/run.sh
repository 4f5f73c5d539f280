#!/usr/bin/env bash
# A path across two servers on one H200 (the crossing batches the requests queued for it), against the
# same cut in one server. From the repository root, after `source scripts/gpu_env.sh`: bash run.sh OUT
set -u
OUT=${1:?output directory}
W=/tmp/cross; mkdir -p "$W" "$OUT"
sed 's/placement: \[1\]/placement: [0]/' plans/bench_cross.yaml > "$W/plan.yaml"
cp "$W/plan.yaml" "$OUT/plan.yaml"
timeout 200 python3 -m blockflow.bench.crossing --plan "$W/plan.yaml" --task classify --out "$W/cross" \
  --concurrency 1,32 --repeats 3 --seconds 2 > "$OUT/cross.log" 2>&1
echo "crossing rc=$?" >> "$OUT/cross.log"
cp "$W/cross/report.md" "$W/cross/results.json" "$OUT/" 2>/dev/null
