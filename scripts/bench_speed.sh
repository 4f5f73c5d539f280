#!/usr/bin/env bash
# The speed figures of one GPU machine, every input mode, with and without MPS, into one directory:
#
#   scripts/bench_speed.sh OUT [PLAN]        # PLAN: plans/bench_r50_speed.yaml
#
# For MPS off, then on (OUT/mps_off, OUT/mps_on): blockflow.bench.like_for_like rows of fp16 images as
# uint8 from host memory and from CUDA shared memory, JPEG files, and float32 from host memory and CUDA
# shared memory, each row one server serving the 4-block split and the unsplit graph in the plan's
# instances (the default plan: the chain that served best on one H200, its unsplit model x4). The rows
# whose first block ingests on the host (JPEG files, float32 from host memory: decoding, or 4x the bytes
# of uint8) give that block, and so the unsplit model, HOST_INSTANCES (4) instances; INSTANCES=N gives
# every row's first block N. perf_analyzer's asynchronous loop on CLIENT_THREADS threads (16) at
# concurrency 1, 32, 128 and 256 (CONCURRENCY), every row with the GPU alone measured first
# (meta.gpu_alone); OUT/mps_*/like_for_like.md: one table of every row. On a machine with several GPUs,
# also OUT/gpu0 (the uint8 row on GPU 0 alone, MPS on) against OUT/mps_on/fp16_u8_host (every GPU: each
# block replicated on each), and OUT/pipelined (blockflow bench --sections gpus: the uint8 task's blocks
# spread over 2 and 4 GPUs). A row already measured is kept (whatever instances it served), so a run cut
# short (a machine's time limit) goes on where it stopped when called again with the same OUT.
# docs/benchmarking.md reads the results.
set -euo pipefail
OUT="${1:?usage: scripts/bench_speed.sh OUT [PLAN]}"
PLAN="${2:-plans/bench_r50_speed.yaml}"
ROWS="${ROWS:-fp16_u8_host,fp16_u8_cudashm,fp16_jpeg_host,fp16_host,fp16_cudashm}"
PY="${PYTHON:-python3}"
CONCURRENCY="${CONCURRENCY:-1,32,128,256}"
instances=()
if [ -n "${INSTANCES:-}" ]; then instances=(--instances "$INSTANCES"); fi
load=(--concurrency "$CONCURRENCY" --client-threads "${CLIENT_THREADS:-16}" --repeats 3 --seconds 1.5)
# The rows in two groups: the plan's first block, and the host-heavy rows with HOST_INSTANCES of it (on one H200
# the head x2 held the rows of float32 from host memory and JPEG files to 0.61-0.67x the unsplit model x4; x4 gave
# 0.76-1.08x in another lease: bench/results/h200/speed_more-2026-12-02-bb110da). Then one table of every row.
plain=() heavy=()
for row in ${ROWS//,/ }; do
  case "$row" in *_jpeg_host|fp16_host|tf32_host|fp32_host) heavy+=("$row") ;; *) plain+=("$row") ;; esac
done
if [ -n "${INSTANCES:-}" ]; then plain+=("${heavy[@]}"); heavy=(); fi
csv() { local IFS=,; echo "$*"; }
for mps in off on; do
  flag=(); if [ "$mps" = on ]; then flag=(--mps); fi
  if [ "${#plain[@]}" -gt 0 ]; then
    "$PY" -m blockflow.bench.like_for_like --plan "$PLAN" --rows "$(csv "${plain[@]}")" "${instances[@]}" "${load[@]}" \
      "${flag[@]}" --out "$OUT/mps_$mps"
  fi
  if [ "${#heavy[@]}" -gt 0 ]; then
    "$PY" -m blockflow.bench.like_for_like --plan "$PLAN" --rows "$(csv "${heavy[@]}")" --instances "${HOST_INSTANCES:-4}" \
      "${load[@]}" "${flag[@]}" --out "$OUT/mps_$mps"
  fi
  # One table of every row (each row's report names its instances).
  "$PY" -m blockflow.bench.like_for_like --rows "$ROWS" --summary --out "$OUT/mps_$mps" > /dev/null
done
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 "$PY" -m blockflow.bench.like_for_like --plan "$PLAN" --rows fp16_u8_host "${instances[@]}" \
    "${load[@]}" --mps --out "$OUT/gpu0"
  # The uint8 row's copy of the plan (like_for_like wrote it; the first row's where ROWS lacks it), its blocks
  # spread over the GPUs.
  first="fp16_u8_host"; case ",$ROWS," in *",fp16_u8_host,"*) ;; *) first="${ROWS%%,*}" ;; esac
  [ -f "$OUT/pipelined/results.json" ] || "$PY" -m blockflow bench --plan "$OUT/mps_on/$first/plan.yaml" --precision fp16 --sections gpus \
    "${load[@]}" --mps --out "$OUT/pipelined"
fi
