#!/usr/bin/env bash
# Set up BlockFlow from nothing on a CPU or GPU Linux machine (Debian 12 / Ubuntu 24.04):
# a virtual environment in .venv with the project (editable), torch, pyzmq, tritonclient,
# and the real Triton Inference Server (inside the nvidia-pytriton wheel).
# Idempotent: a second run only checks, unless pyproject.toml or this script changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BLOCKFLOW_VENV:-$ROOT/.venv}"
log() { printf '[setup] %s\n' "$*" >&2; }

# Triton's Python-backend stub embeds the system libpython3.X.so.1.0, so the venv must be built on
# the system Python of the same version (not, say, a pyenv build).
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in /usr/bin/python3 "$(command -v python3 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { log "no python3 found; install Python 3.11-3.13"; exit 1; }
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
# The range pyproject.toml's requires-python gives (a test checks that they agree).
case "$PYVER" in 3.11|3.12|3.13) ;; *) log "$PY is Python $PYVER; BlockFlow needs Python 3.11-3.13 (set PYTHON=...)"; exit 1;; esac

apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing $* with apt-get"
    (apt-get install -y -q "$@" >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null)
  else
    log "missing system package(s): $* -- install them (e.g. sudo apt-get install $*) and rerun"; exit 1
  fi
}
if ! ldconfig -p 2>/dev/null | grep -q "libpython${PYVER}.so.1.0"; then apt_install "libpython${PYVER}"; fi
if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then apt_install "python${PYVER}-venv"; fi
# A real terminal for the test of `blockflow status --watch` at 80x24.
if ! command -v tmux >/dev/null; then apt_install tmux; fi
# A C compiler builds the library that keeps tritonserver's admin key off its command line (docs/security.md).
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then apt_install gcc libc6-dev; fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $PY (Python $PYVER)"
  "$PY" -m venv "$VENV"
fi

# A real Prometheus for the metrics tests (promtool's lint, a scrape joined with Triton's series):
# the two binaries of Debian's package, into the venv, so no system service is installed or started.
if [ ! -x "$VENV/bin/prometheus" ] || [ ! -x "$VENV/bin/promtool" ]; then
  PROM_TMP="$(mktemp -d)"
  if (cd "$PROM_TMP" && { apt-get download -q prometheus >/dev/null 2>&1 ||
        { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download -q prometheus >/dev/null; }; }); then
    log "installing prometheus and promtool (Debian's package) into $VENV/bin"
    dpkg-deb -x "$PROM_TMP"/prometheus_*.deb "$PROM_TMP/x"
    install -m 0755 "$PROM_TMP/x/usr/bin/prometheus" "$PROM_TMP/x/usr/bin/promtool" "$VENV/bin/"
  else
    log "could not download Debian's prometheus package: the Prometheus tests will be skipped (failed under CI)"
  fi
  rm -rf "$PROM_TMP"
fi

# nginx, the HTTP front door of every server BlockFlow starts (blockflow/triton/front_door.py): the binary of
# Debian's package, into the venv, so no system service is installed or started. One on PATH does as well.
if [ ! -x "$VENV/bin/nginx" ] && ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  NGINX_TMP="$(mktemp -d)"
  if (cd "$NGINX_TMP" && { apt-get download -q nginx >/dev/null 2>&1 ||
        { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download -q nginx >/dev/null; }; }); then
    log "installing nginx (Debian's package) into $VENV/bin"
    dpkg-deb -x "$NGINX_TMP"/nginx_*.deb "$NGINX_TMP/x"
    install -m 0755 "$NGINX_TMP/x/usr/sbin/nginx" "$VENV/bin/"
  else
    log "could not download Debian's nginx package: install nginx (or name it in BLOCKFLOW_NGINX); serve needs it"
  fi
  rm -rf "$NGINX_TMP"
fi

STAMP="$VENV/.blockflow-setup"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  log "installing BlockFlow and its dependencies (torch, tritonclient, nvidia-pytriton, ...); first time takes a few minutes"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[server,dev]"
  echo "$WANT" > "$STAMP"
fi

# perf_analyzer (from the tritonclient wheel) wants libb64.so.0d and libcudart.so.12 by their plain
# names; the PyTriton wheel carries both under mangled names. Wrap the binary once.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PA="$VENV/bin/perf_analyzer"
if [ -f "$PA" ] && head -c 4 "$PA" | grep -q ELF; then
  mkdir -p "$VENV/libexec" "$VENV/lib/blockflow-pa"
  mv "$PA" "$VENV/libexec/perf_analyzer"
  ln -sf "$(ls "$SITE"/nvidia_pytriton.libs/libb64-*.so.0d | head -1)" "$VENV/lib/blockflow-pa/libb64.so.0d"
  ln -sf "$(ls "$SITE"/nvidia_pytriton.libs/libcudart-*.so.12* | head -1)" "$VENV/lib/blockflow-pa/libcudart.so.12"
  cat > "$PA" <<WRAP
#!/bin/sh
# Wrapper written by scripts/setup.sh: gives perf_analyzer the libraries it needs.
LD_LIBRARY_PATH="$VENV/lib/blockflow-pa:$SITE/nvidia_pytriton.libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$VENV/libexec/perf_analyzer" "\$@"
WRAP
  chmod +x "$PA"
fi
log "ready: $VENV (activate with: source $VENV/bin/activate)"
