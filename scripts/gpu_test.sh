#!/usr/bin/env bash
# On a GPU machine: set up from .bundle (see scripts/gpu_bundle.sh) and run the GPU tests and the
# integration tests with blocks on the GPU. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/gpu_env.sh
source "$ROOT/scripts/gpu_env.sh"
cd "$ROOT"
python3 -m blockflow doctor || true
exec python3 -m pytest -p no:cacheprovider -m "gpu or integration" "$@"
