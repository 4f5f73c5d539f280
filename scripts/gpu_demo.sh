#!/usr/bin/env bash
# On a GPU machine (after source scripts/gpu_env.sh): serve the default plan, call every task over
# HTTP and gRPC, then stop with SIGTERM and check that no stub process is left.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG="${1:-/tmp/blockflow-serve.log}"
python3 -m blockflow serve > "$LOG" 2>&1 &
PID=$!
for _ in $(seq 600); do grep -q "Ctrl-C stops" "$LOG" && break; kill -0 $PID 2>/dev/null || break; sleep 0.5; done
cat "$LOG"
for task in cls_a cls_b det_c full_d; do
  python3 -m blockflow infer "$task" --random --batch 2 --repeat 20
  python3 -m blockflow infer "$task" --random --protocol grpc --repeat 20 | tail -1
done
kill -TERM $PID; wait $PID || true
tail -2 "$LOG"
if pgrep -f triton_python_backend_stub >/dev/null; then echo "LEFTOVER STUBS"; pgrep -af triton_python_backend_stub; exit 1; fi
echo "no stub left"
