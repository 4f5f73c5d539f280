# Source this on a GPU machine (from the repository root, with .bundle carried):
#   source scripts/gpu_env.sh
# It unpacks .bundle once into $BLOCKFLOW_GPU_DIR and points BlockFlow at it: the machine's own
# python3 (with its torch) runs BlockFlow from this checkout, no installation needed.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="${BLOCKFLOW_BUNDLE:-$ROOT/.bundle}"
DEST="${BLOCKFLOW_GPU_DIR:-/tmp/blockflow-gpu}"
if [ ! -f "$BUNDLE/triton.tar.xz" ]; then
  echo "no bundle at $BUNDLE: run ./scripts/gpu_bundle.sh on the development machine and carry .bundle" >&2
  return 1 2>/dev/null || exit 1
fi
if [ ! -x "$DEST/bin/perf_analyzer" ] || [ ! -x "$DEST/bin/nginx" ]; then
  mkdir -p "$DEST/triton" "$DEST/site" "$DEST/bin" "$DEST/lib"
  tar -C "$DEST/triton" -xJf "$BUNDLE/triton.tar.xz"
  tar -C "$DEST/site" -xJf "$BUNDLE/site.tar.xz"
  xz -dc "$BUNDLE/perf_analyzer.xz" > "$DEST/lib/perf_analyzer"; chmod +x "$DEST/lib/perf_analyzer"
  xz -dc "$BUNDLE/nginx.xz" > "$DEST/bin/nginx"; chmod +x "$DEST/bin/nginx"
  LIBS="$DEST/triton/nvidia_pytriton.libs"
  ln -sf "$(ls "$LIBS"/libb64-*.so.0d | head -1)" "$DEST/lib/libb64.so.0d"
  ln -sf "$(ls "$LIBS"/libcudart-*.so.12* | head -1)" "$DEST/lib/libcudart.so.12"
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
    "$DEST/lib" "$LIBS" "$DEST/lib/perf_analyzer" > "$DEST/bin/perf_analyzer"
  chmod +x "$DEST/bin/perf_analyzer"
fi
if [ -f "$BUNDLE/py-spy.xz" ] && [ ! -x "$DEST/bin/py-spy" ]; then  # optional: bundles made before it lack it
  xz -dc "$BUNDLE/py-spy.xz" > "$DEST/bin/py-spy.part" && chmod +x "$DEST/bin/py-spy.part" && mv "$DEST/bin/py-spy.part" "$DEST/bin/py-spy"
fi
export BLOCKFLOW_TRITON_HOME="$DEST/triton/pytriton/tritonserver"
export PYTHONPATH="$ROOT:$DEST/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$DEST/bin:$PATH"
export PYTHONUNBUFFERED=1
# Which commit the reports will name: the stamp written before the call (python -m blockflow.bench.stamp).
python3 -m blockflow.bench.stamp --check || true
