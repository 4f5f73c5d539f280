"""Every environment variable BlockFlow reads, and the layout of a server's runtime directory.

Written once here because two kinds of process read them: ``blockflow serve`` sets them when it
starts ``tritonserver``, and every block process (Triton's Python stub) reads them back.

The runtime directory (0700, one per ``tritonserver``, under ``$XDG_RUNTIME_DIR`` or the temp dir;
made by ``blockflow serve``, or by the block processes of a hand-started server: see
:mod:`blockflow.core.runtime_dir`)::

    <runtime>/
        admin.key            the admin key of Triton's restricted APIs (0600)
        shm.key              the key of Triton's shared-memory API, unless --shm-key-file (0600, or 0640 for --shm-key-group)
        control.token        the control service's bearer token, unless --token-file (0600)
        tritonserver.log     the server's log
        model_repository/    the generated repository, unless --repository
        plans/               the control service's plan history, unless --state-dir
        backends/python/     the Python backend with the stub for this interpreter
        tmq.key              the TensorMQ ticket key (0600, 32 random bytes)
        tmq/                 one ZeroMQ socket and one claim table per producer generation:
            <producer id:016x>-<generation:08x>.sock
            <producer id:016x>-<generation:08x>.claims
        stages/              built block parts kept for the next process that needs them (blockflow serve's
                             servers), unless $BLOCKFLOW_STAGE_CACHE_DIR keeps them across servers (blockflow.backend.stage_cache)
            networks/        seeded networks, traced whole, that parts are cut from (the same module)
        activity             the last execute's time, with --warm-cores-ms (blockflow.core.activity)
        triton-http.sock     Triton's HTTP, behind the front door (blockflow.triton.front_door)
        front-door/          nginx's configuration, logs and buffers

POSIX shared memory under ``/dev/shm`` carries the runtime directory's name, so one server's
leftovers are found and removed without touching another's: :func:`stub_shm_prefix` (Triton's
stub IPC) and :func:`pool_shm_prefix` (TensorMQ host pools).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# -- set by `blockflow serve` for tritonserver and its stubs
RUNTIME_DIR = "BLOCKFLOW_RUNTIME_DIR"  # the server's runtime directory (above)
PYTHONPATH = "BLOCKFLOW_PYTHONPATH"  # roots every generated model.py puts on sys.path (the stub ignores PYTHONPATH)
ACTIVITY_FILE = "BLOCKFLOW_ACTIVITY_FILE"  # --warm-cores-ms: blocks stamp this file at each execute (blockflow.core.activity)
# -- set for tritonserver alone, read by the argv-key library before its main (blockflow/triton/argv_key.c), which
#    then removes them, so its block processes never see them
ADMIN_KEY_FILE_VAR = "BLOCKFLOW_ADMIN_KEY_FILE"  # the file whose key replaces the admin placeholder in the server's arguments
ARGV_KEY_PRELOAD = "BLOCKFLOW_ARGV_KEY_PRELOAD"  # the LD_PRELOAD to give back to the server's children
# -- set by the operator (or a benchmark)
TRITON_HOME = "BLOCKFLOW_TRITON_HOME"  # another tritonserver directory of the nvidia-pytriton layout
ARGV_KEY_LIB = "BLOCKFLOW_ARGV_KEY_LIB"  # the argv-key library built ahead of time (no C compiler needed; the image's)
ALLOW_KEY_ON_COMMAND_LINE = "BLOCKFLOW_ALLOW_KEY_ON_COMMAND_LINE"  # "1": without that library, the key goes on argv
NGINX = "BLOCKFLOW_NGINX"  # the nginx binary of the HTTP front door (blockflow.triton.front_door)
TRACE_DIR = "BLOCKFLOW_TRACE_DIR"  # block processes append JSON lines of their life cycle here
DISABLE_CUDA_GRAPHS = "BLOCKFLOW_DISABLE_CUDA_GRAPHS"  # "1": run GPU blocks eagerly whatever the plan says
KEEP_ALLOCATOR_CACHE = "BLOCKFLOW_KEEP_ALLOCATOR_CACHE"  # "1": keep torch's cache after warm-up (memory runs)
TMQ_PREPARE = "BLOCKFLOW_TMQ_PREPARE"  # "0": TensorMQ producers reserve and sign every batch on the request's path
TMQ_EARLY = "BLOCKFLOW_TMQ_EARLY"  # "0": a TensorMQ block answers only after queuing its GPU work (backend/replies.py)
TMQ_RELEASE = "BLOCKFLOW_TMQ_RELEASE"  # "message": consumers release samples with ZeroMQ RELEASE messages; else as bits in the claim table (backend/tensormq/claims.py)
TMQ_HANDOVER_DGRAM = "BLOCKFLOW_TMQ_HANDOVER_DGRAM"  # "0": direct hand-overs over ZeroMQ only; else as AF_UNIX datagrams first, ZeroMQ the fallback (backend/tensormq/wire.py)
PIN_HOST_INPUTS = "BLOCKFLOW_PIN_HOST_INPUTS"  # "0": a first block's host images go to the GPU through the driver's staging (backend/host_pins.py)
LOGITS_ON_GPU = "BLOCKFLOW_LOGITS_ON_GPU"  # "1": last blocks answer with GPU tensors (benchmarks of the data path)
CUDA_SCHEDULE = "BLOCKFLOW_CUDA_SCHEDULE"  # auto, spin, yield, blocking: how a block's threads wait for its GPU (blockflow.core.cuda.set_schedule)
# sleep, spin: how a block's threads wait for the GPU work of a call (backend/gpu_waits.py): polled briefly, then asleep
# (the default), or spinning a core until it is done, whatever the load (each CUDA context's own default)
GPU_WAIT = "BLOCKFLOW_GPU_WAIT"
GRAPH_BUCKETS = "BLOCKFLOW_GRAPH_BUCKETS"  # "quarter": CUDA graphs at quarter steps above 16 too, not powers of two only (backend/graphs.py)
TOKEN = "BLOCKFLOW_TOKEN"  # the control service's bearer token, for `blockflow serve` and `blockflow apply`
# -- where the client commands find a server (flag, then variable, then the endpoints file: blockflow.core.endpoints)
TOKEN_FILE = "BLOCKFLOW_TOKEN_FILE"  # a file holding that token
# The file holding the key of Triton's shared-memory API: set for tritonserver by `blockflow serve` (its argv-key
# library reads it, then removes it), and read by clients that register regions (else the endpoints file names it).
SHM_KEY_FILE_VAR = "BLOCKFLOW_SHM_KEY_FILE"
HTTP_URL = "BLOCKFLOW_HTTP_URL"  # Triton's HTTP endpoint, host:port
GRPC_URL = "BLOCKFLOW_GRPC_URL"  # Triton's gRPC endpoint, host:port
METRICS_URL = "BLOCKFLOW_METRICS_URL"  # Triton's metrics, http://host:port/metrics
CONTROL_URL = "BLOCKFLOW_CONTROL_URL"  # the control service, http://host:port
ENDPOINTS = "BLOCKFLOW_ENDPOINTS"  # the endpoints file `blockflow serve` writes and the client commands read
LOG_LEVEL = "BLOCKFLOW_LOG_LEVEL"  # the CLI's --log-level: debug, info, warning, error
LOG_FORMAT = "BLOCKFLOW_LOG_FORMAT"  # the CLI's --log-format: text, json
COMMIT = "BLOCKFLOW_COMMIT"  # the commit benchmark reports name, where the checkout is a copy without its history
BUNDLE = "BLOCKFLOW_BUNDLE"  # the GPU machines' bundle directory (scripts/gpu_env.sh), where the tree's stamp lies (bench/stamp.py)
STAGE_CACHE = "BLOCKFLOW_STAGE_CACHE"  # "0": every block process builds its parts (no stages/ cache)
# A directory of this user's (0700) keeping built parts across servers, instead of each runtime directory's stages/.
STAGE_CACHE_DIR_VAR = "BLOCKFLOW_STAGE_CACHE_DIR"

# The switches above that change how blocks run (each a lever measured against its default): benchmarks record
# those set in their results (bench.harness.switches), as the server and its block processes inherit them.
SWITCHES = (DISABLE_CUDA_GRAPHS, KEEP_ALLOCATOR_CACHE, TMQ_PREPARE, TMQ_EARLY, TMQ_RELEASE, TMQ_HANDOVER_DGRAM,
            PIN_HOST_INPUTS, LOGITS_ON_GPU, STAGE_CACHE, CUDA_SCHEDULE, GPU_WAIT, GRAPH_BUCKETS)
# The values each switch takes, its default first (unset or empty is the default). Any other value fails the
# server's start and each block's load, naming the variable: a typo (``BLOCKFLOW_TMQ_EARLY=off``) would
# otherwise run the default without a word.
SWITCH_VALUES: dict[str, tuple[str, ...]] = {
    DISABLE_CUDA_GRAPHS: ("0", "1"), KEEP_ALLOCATOR_CACHE: ("0", "1"), TMQ_PREPARE: ("1", "0"), TMQ_EARLY: ("1", "0"),
    TMQ_RELEASE: ("table", "message"), TMQ_HANDOVER_DGRAM: ("1", "0"), PIN_HOST_INPUTS: ("1", "0"),
    LOGITS_ON_GPU: ("0", "1"), STAGE_CACHE: ("1", "0"), CUDA_SCHEDULE: ("auto", "spin", "yield", "blocking"),
    GPU_WAIT: ("sleep", "spin"), GRAPH_BUCKETS: ("pow2", "quarter"),
}


def switch_problems(environ: Mapping[str, str]) -> list[str]:
    """One line per switch set in ``environ`` to a value it does not take (none: all are fine)."""
    return [f"{name}={value!r} is not one of {', '.join(SWITCH_VALUES[name])} (its default: {SWITCH_VALUES[name][0]})"
            for name in SWITCHES if (value := environ.get(name, "")) and value not in SWITCH_VALUES[name]]

ADMIN_KEY_FILE = "admin.key"
SHM_KEY_FILE = "shm.key"
CONTROL_TOKEN_FILE = "control.token"
SERVER_LOG = "tritonserver.log"
REPOSITORY_DIR = "model_repository"
PLANS_DIR = "plans"
TMQ_KEY_FILE = "tmq.key"
TMQ_DIR = "tmq"
STAGE_CACHE_DIR = "stages"
NETWORK_CACHE_DIR = "networks"
ACTIVITY_STAMP = "activity"


def producer_socket(runtime_dir: Path, producer_id: int, generation: int) -> Path:
    return runtime_dir / TMQ_DIR / f"{producer_id:016x}-{generation:08x}.sock"


def claims_file(socket: Path) -> Path:
    """A producer generation's claim table, beside its socket."""
    return socket.with_suffix(".claims")


def stub_shm_prefix(server_pid: int, runtime_dir: Path) -> str:
    """Triton's ``shm-region-prefix-name`` for the stubs of one server."""
    return f"blockflow{server_pid}_{runtime_dir.name}_"


def pool_shm_prefix(runtime_dir: Path) -> str:
    """The start of every TensorMQ host pool's shared-memory name of one server."""
    return f"blockflow-tmq-{runtime_dir.name}-"


def pool_shm_name(runtime_dir: Path, producer: int, generation: int) -> str:
    """The shared-memory name of one producer generation's host pool."""
    return f"{pool_shm_prefix(runtime_dir)}{producer:016x}-{generation:08x}"
