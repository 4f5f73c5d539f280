#!/usr/bin/env bash
# The speed figures of one GPU machine, every input mode, with and without MPS, into one directory:
#
#   scripts/bench_speed.sh OUT [PLAN]        # PLAN: plans/bench_r50_graph.yaml
#
# For MPS off, then on (OUT/mps_off, OUT/mps_on): blockflow.bench.like_for_like rows of fp16 images as
# uint8 from host memory and from CUDA shared memory, JPEG files, and float32 from host memory and CUDA
# shared memory, each row one server serving the 4-block split and the unsplit graph, the first block
# (and so the unsplit model) in $INSTANCES instances (4), perf_analyzer at concurrency 1, 32 and 128,
# every row with the GPU alone measured first (meta.gpu_alone). On a machine with several GPUs, also
# OUT/gpu0 (the uint8 row on GPU 0 alone, MPS on) against OUT/mps_on/fp16_u8_host (every GPU: each block
# replicated on each), and OUT/pipelined (blockflow bench --sections gpus: the uint8 task's blocks spread
# over 2 and 4 GPUs). A row already measured is kept, so a run cut short (a machine's time limit) goes
# on where it stopped when called again with the same OUT. docs/benchmarking.md reads the results.
set -euo pipefail
OUT="${1:?usage: scripts/bench_speed.sh OUT [PLAN]}"
PLAN="${2:-plans/bench_r50_graph.yaml}"
INSTANCES="${INSTANCES:-4}"
ROWS="${ROWS:-fp16_u8_host,fp16_u8_cudashm,fp16_jpeg_host,fp16_host,fp16_cudashm}"
PY="${PYTHON:-python3}"
common=(--plan "$PLAN" --rows "$ROWS" --instances "$INSTANCES" --concurrency 1,32,128 --repeats 3 --seconds 1.5)
"$PY" -m blockflow.bench.like_for_like "${common[@]}" --out "$OUT/mps_off"
"$PY" -m blockflow.bench.like_for_like "${common[@]}" --mps --out "$OUT/mps_on"
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 "$PY" -m blockflow.bench.like_for_like --plan "$PLAN" --rows fp16_u8_host --instances "$INSTANCES" \
    --concurrency 1,32,128 --repeats 3 --seconds 1.5 --mps --out "$OUT/gpu0"
  # The uint8 row's copy of the plan (like_for_like wrote it), its blocks spread over the GPUs.
  [ -f "$OUT/pipelined/results.json" ] || "$PY" -m blockflow bench --plan "$OUT/mps_on/fp16_u8_host/plan.yaml" --precision fp16 --sections gpus \
    --concurrency 1,32,128 --repeats 3 --seconds 1.5 --mps --out "$OUT/pipelined"
fi
