"""Which ``tritonserver`` flags a user may pass through ``blockflow serve --tritonserver-arg``."""

from __future__ import annotations

from collections.abc import Sequence

# Triton's CUDA memory pool per GPU, in MiB, unless --cuda-pool-mb says otherwise (why it is this
# large: blockflow.triton.server.ServerOptions.cuda_pool_mb).
CUDA_POOL_MB = 2048

# Flags of tritonserver that BlockFlow sets itself: how the server finds and loads the generated
# models, where it listens, and which APIs need the admin key. A pass-through argument may not
# change them (the restricted APIs above all: the model-control API runs the caller's code).
OWNED_FLAGS = {
    "model-repository": "the repository is generated from the plan",
    "model-store": "the repository is generated from the plan",
    "backend-directory": "BlockFlow prepares the backend directory",
    "model-control-mode": "plan changes go through `blockflow apply`",
    "load-model": "the plan says which models load",
    "disable-auto-complete-config": "the generator writes complete configs",
    "strict-model-config": "the generator writes complete configs",
    "http-address": "use --host", "grpc-address": "use --host", "metrics-address": "use --host",
    "http-port": "use --http-port", "grpc-port": "use --grpc-port", "metrics-port": "use --metrics-port",
    "allow-http": "the tools need HTTP", "allow-grpc": "the control path needs gRPC",
    "allow-metrics": "monitoring needs the metrics endpoint",
    "http-restricted-api": "BlockFlow keeps the model-control, trace and logging APIs behind the admin key",
    "grpc-restricted-api": "BlockFlow keeps the model-control, trace and logging APIs behind the admin key",
    "cuda-memory-pool-byte-size": "use --cuda-pool-mb",
}


def check_extra_args(args: Sequence[str]) -> list[str]:
    """``args`` for tritonserver, each ``--flag=value`` or ``--flag``; ``ValueError`` naming the
    first one BlockFlow sets itself (:data:`OWNED_FLAGS`) or one that is not a long flag."""
    for arg in args:
        if not arg.startswith("--") or len(arg) < 3:
            raise ValueError(f"{arg!r} is not a tritonserver flag; give it as --flag=value")
        flag = arg[2:].split("=", 1)[0]
        # tritonserver parses with getopt_long, which takes any unambiguous abbreviation of a flag.
        owned = next((o for o in OWNED_FLAGS if o.startswith(flag)), None)
        if owned is not None:
            raise ValueError(f"--{owned} is set by BlockFlow ({OWNED_FLAGS[owned]})")
    return list(args)
