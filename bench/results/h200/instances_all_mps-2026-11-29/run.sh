#!/usr/bin/env bash
# Every block of the split in 4 instances, under MPS (uint8 images from host memory, fp16), against the
# unsplit CUDA graph in 4 instances. From the repository root, after `source scripts/gpu_env.sh`: bash run.sh OUT
set -u
OUT=${1:?output directory}
W=/tmp/inst; mkdir -p "$W" "$OUT"
timeout 300 python3 -m blockflow.bench.like_for_like --plan plans/bench_r50_graph.yaml --rows fp16_u8_host \
  --instances 4 --rest-instances 4 --mps --concurrency 1,32,128,256 --repeats 2 --seconds 1.5 \
  --out "$W/mps_i4r4" > "$OUT/run.log" 2>&1
echo "like_for_like rc=$?" >> "$OUT/run.log"
cp "$W/mps_i4r4/like_for_like.md" "$OUT/" 2>/dev/null
tar -C "$W" -czf "$OUT/mps_i4r4.tgz" --exclude='*.log' mps_i4r4 2>/dev/null
