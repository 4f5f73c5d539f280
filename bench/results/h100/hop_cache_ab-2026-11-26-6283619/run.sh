#!/usr/bin/env bash
# GPU tests, then turns: old = 70ba371's runtime.py and tensormq/ticket.py, new = HEAD's; then the stress test.
set -uo pipefail
source scripts/gpu_env.sh
export BLOCKFLOW_COMMIT="$1"; TURNS=$2
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -2
sed -e 's/precision: fp32/precision: fp16/' -e 's/^compare:.*/compare: []/' -e 's/^references:.*/references: [graph]/' plans/bench_r50.yaml > /tmp/r50_tl.yaml
i=0
for turn in ${TURNS//,/ }; do
  i=$((i+1)); name="${i}_${turn}"
  for f in runtime.py tensormq/ticket.py; do cp .ab/hc_$turn/${f//\//__} backend/$f; done
  el "turn $name"
  timeout ${TURN_S:-120} python3 -m blockflow.bench.timeline --plan /tmp/r50_tl.yaml --out /tmp/tl/$name --requests 300 > /tmp/tl_$name.log 2>&1
  el "rc=$?"
  mkdir -p $OUT/hop_cache_ab/$name; cp /tmp/tl/$name/timeline.json $OUT/hop_cache_ab/$name/ 2>/dev/null
done
for f in runtime.py tensormq/ticket.py; do cp .ab/hc_new/${f//\//__} backend/$f; done
python3 - /tmp/tl/* <<'PY'
import json, sys
from pathlib import Path
for d in sys.argv[1:]:
    m = json.loads((Path(d) / "timeline.json").read_text())["models"]
    s, g = m["tensormq"]["median_ms"], m["monolithic-graph"]["median_ms"]
    print(Path(d).name, f"graph {g['end_to_end']:.3f} split {s['end_to_end']:.3f}",
          " ".join(f"{b}: dec {s[b+'.read:decode']*1e3:.0f} chk {s[b+'.run:checks']*1e3:.0f} exec {s[b+'.execute']*1e3:.0f}" for b in ("b1", "b2")),
          f"b3 dec {s['b3.read:decode']*1e3:.0f}")
PY
el stress
timeout 150 python3 -m blockflow.bench.stress --plan plans/default.yaml --jobs 200 --workers 24 --rounds 1 --input cuda,host > $OUT/stress.txt 2>&1; echo "stress rc=$?"; tail -2 $OUT/stress.txt
