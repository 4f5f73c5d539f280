# BlockFlow on NVIDIA's Triton Inference Server image (docs/deploy.md):
#   docker build -t blockflow .
#   docker run --gpus all --shm-size=2g -p 8000-8003:8000-8003 blockflow
# serves plans/default.yaml on every interface. The control service's token comes from
# BLOCKFLOW_TOKEN (docker run -e BLOCKFLOW_TOKEN=...); without it a random one is written to the
# runtime directory, whose path `blockflow serve` prints.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.01-py3

# The library preloaded into tritonserver: it keeps the keys off its command line (blockflow/triton/argv_key.c)
# and the server's shared-memory regions out of reach of Triton's shared-memory API (shm_guard.c). Built in a
# stage of its own from the same image, so that it links against the C library it runs with while the image
# keeps no compiler. The ID is the one blockflow.triton.argv_key checks.
FROM ${TRITON_IMAGE} AS argv-key
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY blockflow/triton/argv_key.c blockflow/triton/shm_guard.c ./
RUN gcc -O2 -shared -fPIC -DARGV_KEY_ID="\"$(cat argv_key.c shm_guard.c | sha256sum | cut -c1-16)\"" -o argv_key.so argv_key.c shm_guard.c -ldl

FROM ${TRITON_IMAGE}

# nginx, the HTTP front door blockflow serve puts before Triton's HTTP (blockflow/triton/front_door.py);
# no service of it is started (serve runs its own, as the server's user).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/*

# The image's Python 3.12 is the one its Python-backend stub embeds, so BlockFlow goes into it
# (PEP 668 marks it externally managed; this image is that environment's only user).
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BLOCKFLOW_TRITON_HOME=/opt/tritonserver \
    BLOCKFLOW_ARGV_KEY_LIB=/opt/blockflow/lib/argv_key.so \
    BLOCKFLOW_NGINX=/usr/sbin/nginx \
    HOME=/tmp/home \
    MPLCONFIGDIR=/tmp/matplotlib

WORKDIR /opt/blockflow
COPY pyproject.toml README.md LICENSE CHANGELOG.md ./
COPY blockflow/ blockflow/
COPY backend/ backend/
COPY ensemble_gen/ ensemble_gen/
COPY clients/ clients/
COPY bench/ bench/
COPY plans/ plans/
COPY monitoring/ monitoring/
# The server comes with the image: the `runtime` extra (torch & co.), not `server` (nvidia-pytriton).
# DL3013 asks for pinned versions: what is installed is this checkout, at the versions pyproject.toml allows.
# hadolint ignore=DL3013
RUN python3 -m pip install --no-compile ".[runtime]" \
    && blockflow --version
COPY --from=argv-key /build/argv_key.so /opt/blockflow/lib/argv_key.so

# The image's unprivileged user, triton-server; runtime directories go under /tmp (or $XDG_RUNTIME_DIR).
USER 1000:1000
EXPOSE 8000 8001 8002 8003
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8003/health/ready', timeout=4)"]
ENTRYPOINT ["blockflow"]
CMD ["serve", "--host", "0.0.0.0", "--plan", "/opt/blockflow/plans/default.yaml"]
