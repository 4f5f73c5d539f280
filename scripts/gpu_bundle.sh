#!/usr/bin/env bash
# Prepare .bundle/: what the offline GPU machines (Ubuntu 24.04, Python 3.12, torch preinstalled)
# lack, small enough to travel with the repository (64 MiB limit):
#   triton.tar.xz   tritonserver, the Python backend, the 3.12 stub and only the libraries they load
#   site.tar.xz     pure-Python / cp312 packages: pyzmq, pydantic, tritonclient (HTTP+gRPC), gevent ...
#   perf_analyzer.xz the perf_analyzer binary from the tritonclient 2.50 wheel
#   py-spy.xz       py-spy, for `python -m blockflow.bench.lab.block_profile` (CPU shares of block processes)
#   nginx.xz        the HTTP front door (Debian 12's nginx binary, as setup.sh puts in .venv/bin; it loads
#                   libssl3, libpcre2-8, zlib and libcrypt, which Ubuntu 24.04 has)
# Run here (after ./scripts/setup.sh); then carry .bundle to the GPU machine and run scripts/gpu_test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BLOCKFLOW_VENV:-$ROOT/.venv}"
OUT="$ROOT/.bundle"
PYV="${GPU_PYTHON_VERSION:-3.12}"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

echo "[bundle] triton server tree"
T="$WORK/triton"; mkdir -p "$T/pytriton/tritonserver/python_backend_stubs" "$T/nvidia_pytriton.libs"
cp -r "$SITE/pytriton/tritonserver/bin" "$SITE/pytriton/tritonserver/caches" "$T/pytriton/tritonserver/"
mkdir -p "$T/pytriton/tritonserver/backends/python"
cp "$SITE/pytriton/tritonserver/backends/python/"{libtriton_python.so,triton_python_backend_utils.py} "$T/pytriton/tritonserver/backends/python/"
cp -r "$SITE/pytriton/tritonserver/python_backend_stubs/$PYV" "$T/pytriton/tritonserver/python_backend_stubs/"
# Only the wheel libraries these binaries load (ldd resolves them transitively).
for f in "$T"/pytriton/tritonserver/bin/tritonserver "$T"/pytriton/tritonserver/backends/python/*.so \
         "$T"/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub "$T"/pytriton/tritonserver/caches/*/*.so; do
  LD_LIBRARY_PATH="$SITE/nvidia_pytriton.libs" ldd "$f" | awk '/nvidia_pytriton.libs/ {print $3}'
done | sort -u | while read -r lib; do cp "$lib" "$T/nvidia_pytriton.libs/"; done
tar -C "$T" -cf - . | xz -T0 -9 > "$OUT/triton.tar.xz"

echo "[bundle] Python packages for cp${PYV/./}"
PKGS=(pyzmq pydantic pydantic-core annotated-types typing-inspection "tritonclient==2.50.0"
      geventhttpclient gevent greenlet zope.event zope.interface python-rapidjson brotli
      fastapi starlette uvicorn h11 anyio sniffio httpx httpcore idna certifi prometheus-client
      psutil nvidia-ml-py click rich markdown-it-py mdurl pygments pyyaml
      opentelemetry-api annotated-doc importlib-metadata zipp safetensors)
"$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WORK/wheels" "${PKGS[@]}"
"$VENV/bin/python" -m pip install -q --no-deps --no-compile --target "$WORK/site" "$WORK"/wheels/*.whl \
  --python-version "$PYV" --only-binary=:all: --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
BIN="$(find "$WORK/site" -path '*/bin/perf_analyzer' | head -1)"
xz -T0 -9 -c "$BIN" > "$OUT/perf_analyzer.xz"
"$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WORK/pyspy" "py-spy==0.4.3"
(cd "$WORK/pyspy" && "$VENV/bin/python" -m zipfile -e py_spy-*.whl x && xz -T0 -9 -c x/py_spy-*.data/scripts/py-spy > "$OUT/py-spy.xz")
rm -rf "$WORK/site/bin"
NGINX="$(command -v "$VENV/bin/nginx" nginx /usr/sbin/nginx 2>/dev/null | head -1)"
[ -n "$NGINX" ] || { echo "[bundle] no nginx: run ./scripts/setup.sh first" >&2; exit 1; }
xz -T0 -9 -c "$NGINX" > "$OUT/nginx.xz"
tar -C "$WORK/site" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
du -ch "$OUT"/* | sed 's/^/[bundle] /'
