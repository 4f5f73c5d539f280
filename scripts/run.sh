#!/usr/bin/env bash
# Set up if needed, then serve the default plan (or: ./scripts/run.sh --plan plans/other.yaml).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
exec "${BLOCKFLOW_VENV:-$ROOT/.venv}/bin/blockflow" serve "$@"
