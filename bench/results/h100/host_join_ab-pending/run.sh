#!/usr/bin/env bash
# For branch host-join-dma: GPU tests, stress, then BLOCKFLOW_PIN_HOST_INPUTS off and on in perf_analyzer turns
# (fp16, host inputs, no warm cores). Off: images go through the driver's staging, several joined by one
# blocking .to(device) each. On: page-locked, a call of one image by DMA, several joined by one DMA each.
# Pinning alone (b442cdb, main) moved the split's c32 within the turns' spread: a change here is the join's.
#   bash run.sh COMMIT [VALUES]     (rename this folder to host_join_ab-DATE-COMMIT with the results)
set -uo pipefail
source scripts/gpu_env.sh
export BLOCKFLOW_COMMIT="$1"; VALUES="${2:-0,1,0,1}"
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
el gpu-tests
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu -rs > $OUT/gpu_tests.txt 2>&1; echo "gpu rc=$?"; tail -4 $OUT/gpu_tests.txt
el stress
timeout 150 python3 -m blockflow.bench.stress --plan plans/default.yaml --jobs 200 --workers 24 --rounds 1 --input cuda,host > $OUT/stress.txt 2>&1; echo "stress rc=$?"; tail -3 $OUT/stress.txt
el turns
sed -e 's/^compare:.*/compare: []/' -e 's/^references:.*/references: [graph]/' plans/bench_r50.yaml > /tmp/r50_ab.yaml
python3 -m blockflow.bench.turns --env BLOCKFLOW_PIN_HOST_INPUTS --values "$VALUES" --row fp16_host \
  --plan /tmp/r50_ab.yaml --out /tmp/turns --turn-s 135 2>&1 | grep -E "^\[turns\]|^\| |^- |Traceback|Error" | tail -40
mkdir -p $OUT/fp16_host; cp /tmp/turns/turns.md $OUT/fp16_host/
for d in /tmp/turns/*_*/; do cp ${d}fp16_host/results.json $OUT/fp16_host/$(basename $d).json 2>/dev/null; done
el done
