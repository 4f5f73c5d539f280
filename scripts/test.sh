#!/usr/bin/env bash
# Set up if needed, then type-check and run the test suite (GPU tests are skipped without a GPU).
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not integration".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
VENV="${BLOCKFLOW_VENV:-$ROOT/.venv}"
cd "$ROOT"
echo "== mypy --strict"
"$VENV/bin/python" -m mypy
echo "== pytest"
exec "$VENV/bin/python" -m pytest "$@"
