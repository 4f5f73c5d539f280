#!/usr/bin/env bash
# Regenerate model_repository/ (from plans/default.yaml) and the golden test repositories.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BF="${BLOCKFLOW_VENV:-$ROOT/.venv}/bin/blockflow"
cd "$ROOT"
"$BF" generate plans/default.yaml -o model_repository
for plan in tests/plans/*.yaml; do
  "$BF" generate "$plan" -o "tests/golden/$(basename "$plan" .yaml)"
done
