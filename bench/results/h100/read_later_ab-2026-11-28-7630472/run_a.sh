#!/usr/bin/env bash
# Stress (host and CUDA inputs) on the chain and on the default plan, then two traced turns
# (BLOCKFLOW_TMQ_READ_LATER 0, 1; fp16, host inputs), with progress in $OUT/progress.txt.
set -uo pipefail
source scripts/gpu_env.sh >/dev/null 2>&1
export BLOCKFLOW_COMMIT="$1"
P=$OUT/progress.txt
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s $(date -u +%H:%M:%S)] $*" >> $P; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $P; nproc >> $P
el stress-r50
timeout 150 python3 -m blockflow.bench.stress --plan plans/bench_r50.yaml --jobs 200 --workers 24 --rounds 1 --input cuda,host > $OUT/stress_r50.txt 2>&1; el "stress rc=$?"; tail -3 $OUT/stress_r50.txt >> $P
el stress-default
timeout 130 python3 -m blockflow.bench.stress --plan plans/default.yaml --jobs 200 --workers 24 --rounds 1 --input cuda,host > $OUT/stress_default.txt 2>&1; el "stress rc=$?"; tail -3 $OUT/stress_default.txt >> $P
el traced-turns
sed -e 's/^compare:.*/compare: []/' -e 's/^references:.*/references: [graph]/' plans/bench_r50.yaml > /tmp/r50_ab.yaml
timeout 250 python3 -m blockflow.bench.traced_turns --env BLOCKFLOW_TMQ_READ_LATER --values 0,1 --precision fp16 \
  --plan /tmp/r50_ab.yaml --out /tmp/tt > /tmp/tt.log 2>&1; el "traced rc=$?"; tail -3 /tmp/tt.log >> $P
mkdir -p $OUT/traced; cp /tmp/tt/traced_turns.md $OUT/traced/ 2>/dev/null
for d in /tmp/tt/*_*/; do cp $d/timeline.json $OUT/traced/$(basename $d).json 2>/dev/null; done
el done
