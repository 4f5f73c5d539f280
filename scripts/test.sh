#!/usr/bin/env bash
# Set up if needed, then lint, check the import layers, type-check, check the deployment files
# (scripts/check_deploy.sh) and run the test suite (GPU tests are skipped without a GPU).
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not integration".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
VENV="${BLOCKFLOW_VENV:-$ROOT/.venv}"
cd "$ROOT"
echo "== ruff (lint)"
"$VENV/bin/ruff" check .
echo "== import contracts (the layers in docs/architecture.md)"
"$VENV/bin/lint-imports" --no-logo
echo "== mypy --strict"
"$VENV/bin/python" -m mypy
"$ROOT/scripts/check_deploy.sh"
echo "== pytest"
exec "$VENV/bin/python" -m pytest "$@"
