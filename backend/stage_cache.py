"""Built stages kept between a block's processes, in the server's private runtime directory.

Building a part means importing torchvision (about 1 s of CPU, most of it ``torch._dynamo``,
which ``torchvision.ops`` pulls in), building the whole network under its seed and tracing it.
A live plan change starts new block processes for blocks that often ran before (a reload, a
second instance, a plan changed back), so the first process to build a part keeps it here and
the next ones load it: a pickled ``GraphModule`` whose code refers to ``torch`` only, unless the
network calls a torchvision function (EfficientNet's stochastic depth), in which case loading it
imports torchvision as building would.

The next process that needs another part of the same network (a block of the same seed, its
reference) cuts it from the whole network, traced, which the first process to build that network keeps
beside the parts (``networks/``): a pickled ``GraphModule``, kept only where it loads back as the same
graph (its generated code compares equal), with each node's module path. Processes that need a network
another one is building wait for it (a lock file per network, at most ``NETWORK_WAIT_S``) instead of
building it too: a server's block processes start several at a time, and several of them are often cut
from one network; a kept network loads without the lock. A network that never can be kept (too large, unpicklable, not
the same graph once loaded) leaves an empty file that says so, and the processes waiting for it build their
own at once; one that cannot be kept now (no room, a failed write) is noted in its lock file, and for
``NOT_KEPT_LATELY_S`` the processes that need it build their own at once.

Entries are keyed by everything that defines the part (network or exported program's bytes,
cuts, stages, the seed or the weights file's bytes, the torch and torchvision versions, and torch's
intra-op thread count and CPU capability (AVX2, AVX-512...): a network whose batch-norm statistics are
drawn at build time rounds them by both, and a GPU block process builds on one thread where a CPU one
builds on several).

The directory is the runtime directory's ``stages/`` (one server's), or ``$BLOCKFLOW_STAGE_CACHE_DIR``,
kept across servers (a restart, a test suite's many servers; nothing removes its entries, which are
keyed by versions, so clearing it is its owner's to do). Either is checked private (0700, the user's own,
not a link): what is unpickled here was written by this user's own block processes, which already run
code from the model repository. Each entry is opened without following links and used only if it is a
regular file of the user's that no one else can write. User-supplied weights are never unpickled
(``weights_only`` loads, in ``blockflow.backend.runtime``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import torch
from torch import fx, nn

from blockflow.core import env, programs
from blockflow.core.arch import Traced
from blockflow.core.errors import EnvironmentProblem
from blockflow.core.runtime_dir import open_own, private_dir, write_private_file
from blockflow.core.spec import ModelSpec, Part
from blockflow.core.trained_weights import trained_weights

FORMAT = 3
# BlockFlow's modules that build a part from its spec: their source is in the key, so a kept part is
# never one that older code built (a directory kept across servers outlives a checkout's commit).
BUILD_CODE = ("blockflow.backend.parts", "blockflow.core.arch", "blockflow.core.cuts", "blockflow.core.folding",
              "blockflow.core.in_place", "blockflow.core.detection", "blockflow.core.programs",
              "blockflow.core.stage_files", "blockflow.core.trained_weights")
# Parts larger than this are not kept: the runtime directory may be in memory (tmpfs).
MAX_BYTES = 512 << 20
# How long a process waits for another one building the network it needs before building it too
# (well under `blockflow serve`'s load timeout; a build takes seconds).
NETWORK_WAIT_S = 60.0
# After a process could not keep a network for a passing reason (no room, a write that failed), the next
# ones build theirs at once, without waiting for each other, for this long; then one tries to keep it again.
NOT_KEPT_LATELY_S = 600.0
# temp_path's names for an entry, and two earlier versions' (``.<digest>.pt.<pid>``, ``.<digest>.pt.<pid>.tmp``).
_ENTRY_TEMP = re.compile(r"\.[0-9a-f]{32}\.pt\.([1-9][0-9]{0,6})(?:\.[0-9a-f]{8}\.tmp|\.tmp)?")
# A torchvision network: its name, classes, per-sample input shape and seed (``blockflow.backend.parts.network_key``).
NetworkKey = tuple[str, int, tuple[int, ...], int]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


@functools.cache
def build_code_digest() -> str:
    """A digest of :data:`BUILD_CODE`'s source files (found without importing them)."""
    h = hashlib.blake2b(digest_size=16)
    for name in BUILD_CODE:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        h.update(name.encode() + b"\0" + (Path(origin).read_bytes() if origin else b"missing") + b"\0")
    return h.hexdigest()


def _open_own(path: Path) -> IO[bytes] | None:
    """``path`` opened for reading if it is a regular file of this user's that no one else can write (never through
    a link); None if not (any problem with a kept file counts as a miss)."""
    try:
        return open_own(path, "kept file")
    except (OSError, EnvironmentProblem):
        return None


def has_room(directory: Path, size: int) -> bool:
    """Whether ``directory``'s file system keeps ``size`` more bytes and still has a margin free (a fifth of it,
    at least 256 MiB, at most 1 GiB): the runtime directory is often a small tmpfs that also holds TensorMQ's sockets."""
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return False
    return usage.free - size >= max(256 << 20, min(usage.total // 5, 1 << 30))


def _remove_orphans(directory: Path) -> None:
    """Temporary files of processes that died while saving an entry into ``directory``: only names this
    cache writes (:func:`~blockflow.core.runtime_dir.temp_path`'s of ``<digest>.pt``, and earlier versions').
    In another pid namespace a live writer can look dead here; its rename then fails and it keeps nothing,
    as with a full disk."""
    for tmp in directory.glob(".*.pt.*"):
        m = _ENTRY_TEMP.fullmatch(tmp.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # not a file of ours after all (a directory): left
        except OSError:
            pass  # alive (another user's pid): not ours to judge


@contextmanager
def _locked(path: Path, wait_s: float = NETWORK_WAIT_S) -> Iterator[int | None]:
    """Hold the lock file ``path`` (made if absent), giving its descriptor: waits for its holder, at most
    ``wait_s``, then goes on without it, giving None (best effort: a lock that cannot be taken only means
    building what another process builds)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield None
        return
    try:
        deadline = time.monotonic() + wait_s
        held = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            except OSError:
                break
        yield fd if held else None
    finally:
        os.close(fd)  # releases the lock


def _not_kept_lately(lock: int) -> bool:
    """Whether the lock file (held) says a process could not keep its network within ``NOT_KEPT_LATELY_S``."""
    try:
        return 0 <= time.time() - float(os.pread(lock, 32, 0).decode()) < NOT_KEPT_LATELY_S  # (a clock set back: not lately)
    except (OSError, ValueError):
        return False  # empty (kept, or never tried) or unreadable


def _say_not_kept_now(lock: int) -> None:
    try:
        os.ftruncate(lock, 0)
        os.pwrite(lock, repr(time.time()).encode(), 0)
    except OSError:
        pass


def _entry_name(fields: dict[str, object]) -> str:
    """The file name of the entry ``fields`` define, with what else builds it: the entry format, torch's thread
    count and CPU capability, BlockFlow's build code, torch's and torchvision's versions."""
    key = {**fields, "format": FORMAT, "threads": torch.get_num_threads(), "cpu": torch.backends.cpu.get_cpu_capability(),
           "code": build_code_digest(), "torch": torch.__version__, "torchvision": _version("torchvision")}
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest() + ".pt"


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class StageCache:
    """Built parts (CPU, fp32, eval mode) in ``directory``, one file per part."""

    def __init__(self, directory: Path, keeps_networks: bool = True) -> None:
        self.directory = directory
        self.directory.mkdir(mode=0o700, exist_ok=True)
        self.networks: Path | None = None
        if keeps_networks:
            try:  # best effort: without it, each process builds the networks it needs
                self.networks = private_dir(directory / env.NETWORK_CACHE_DIR, what="network cache directory")
            except EnvironmentProblem:
                pass
        for kept in (self.directory, self.networks):
            if kept is not None:
                _remove_orphans(kept)

    @property
    def keeps_networks(self) -> bool:
        return self.networks is not None

    def network_path(self, key: NetworkKey) -> Path:
        assert self.networks is not None
        arch, num_classes, input_shape, seed = key
        return self.networks / _entry_name({"arch": arch, "num_classes": num_classes, "input_shape": list(input_shape), "seed": seed})

    def network(self, key: NetworkKey, build: Callable[[], Traced]) -> Traced:
        """The network ``key`` names, traced: kept by another process, else ``build()`` (and kept).

        While one process builds it, the others that need it wait for it (a lock file per network); a kept
        one loads without the lock."""
        path = self.network_path(key)
        kept = _load_network(path)
        if kept is not None:
            return kept
        if not _not_kept(path):
            with _locked(path.with_suffix(".lock")) as lock:
                kept = _load_network(path)
                if kept is not None:
                    return kept
                # (else another process found it cannot be kept, for good or for now, while this one waited)
                if not _not_kept(path) and not (lock is not None and _not_kept_lately(lock)):
                    traced = build()
                    if not _store_network(path, traced) and lock is not None:
                        _say_not_kept_now(lock)
                    return traced
        return build()  # without the lock: each process that needs it builds its own at once

    @classmethod
    def configured(cls) -> StageCache | None:
        """``$BLOCKFLOW_STAGE_CACHE_DIR``'s cache (``EnvironmentProblem`` if it is relative, cannot be made or is not
        private), else the server's (its runtime directory's ``stages/``, if that directory is private); None outside
        a server started by ``blockflow serve`` or when ``BLOCKFLOW_STAGE_CACHE=0``."""
        if os.environ.get(env.STAGE_CACHE) == "0":
            return None
        kept = os.environ.get(env.STAGE_CACHE_DIR_VAR)
        if kept:  # asked for by name: a directory that cannot be used is an error, not a silent slow start
            if not os.path.isabs(kept):
                raise EnvironmentProblem(f"{env.STAGE_CACHE_DIR_VAR}={kept!r} must be an absolute path (each block "
                                         f"process has its own working directory)")
            return cls(private_dir(Path(kept), what="stage cache directory", setting=env.STAGE_CACHE_DIR_VAR))
        runtime = os.environ.get(env.RUNTIME_DIR)
        if not runtime or not Path(runtime).is_dir():
            return None
        try:  # best effort: a runtime directory others can open keeps no parts (its TensorMQ refuses it anyway)
            return cls(private_dir(private_dir(Path(runtime), create=False) / env.STAGE_CACHE_DIR))
        except EnvironmentProblem:
            return None

    def path(self, spec: ModelSpec, part: Part) -> Path:
        weights: dict[str, object] = {"seed": part.weights.seed}
        if part.weights.file is not None:
            weights = {"file": _file_digest(part.weights.file)}
        elif part.weights.torchvision is not None:  # torchvision's file names carry a hash of their content
            weights = {"torchvision": part.weights.torchvision, "url": trained_weights(spec.arch, part.weights.torchvision).url}
        # An exported program is keyed by its bytes (its weights and graph), not only its path.
        network: object = spec.arch
        if programs.is_program(spec.arch):
            network = {"program": _file_digest(spec.arch)}
        elif spec.stage_files:
            network = {"stage_files": [_file_digest(f) for f in spec.stage_files[part.first:part.last + 1]]}
        return self.directory / _entry_name({"arch": network, "cut_points": spec.cut_points, "num_classes": spec.num_classes,
                                             "input_shape": spec.input_shape, "first": part.first, "last": part.last,
                                             "weights": weights})

    def load(self, entry: Path) -> nn.Module | None:
        """The part kept at ``entry`` (:meth:`path`), if it is usable (any problem with it counts as a miss)."""
        f = _open_own(entry)
        if f is None:
            return None
        with f:
            try:
                module = torch.load(f, map_location="cpu", weights_only=False)
            except Exception:  # a truncated or stale entry: build again
                return None
        return module.eval() if isinstance(module, nn.Module) else None

    def store(self, entry: Path, module: nn.Module) -> None:
        """Keep ``module`` at ``entry`` (:meth:`path`, keyed before it was built) for the next process (atomically; best effort)."""
        size = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        if size > MAX_BYTES or not has_room(self.directory, size):
            return
        try:
            write_private_file(entry, lambda f: torch.save(module, f))
        except Exception:  # a full disk or an unpicklable module: the next process builds it again
            pass


def _not_kept(path: Path) -> bool:
    """Whether ``path`` says its network is never kept (an empty file of this user's: too large, unpicklable,
    or it does not load back as built)."""
    f = _open_own(path)
    if f is None:
        return False
    with f:
        return os.fstat(f.fileno()).st_size == 0


def _load_network(path: Path) -> Traced | None:
    """The network kept at ``path``, if it is usable: loads as the graph it was built as (any problem is a miss)."""
    f = _open_own(path)
    if f is None:
        return None
    with f:
        try:
            kept: Any = torch.load(f, map_location="cpu", weights_only=False)
            module, code, paths = kept["module"], kept["code"], kept["paths"]
            if not (isinstance(module, fx.GraphModule) and module.code == code):
                return None
            return Traced.of(module, [paths[n.name] for n in module.graph.nodes])
        except Exception:  # a truncated or stale entry: build again
            return None


def _store_network(path: Path, traced: Traced) -> bool:
    """Keep ``traced`` for the next process, only where it loads back as the same graph; whether that is
    settled. A network that never can be (too large, a graph that cannot be copied, unpicklable, not the same graph once
    loaded) leaves an empty file that says so, and the processes waiting for it build their own at once
    (True). One that cannot be kept now (no room; a write that failed: a full disk, which ``torch.save``
    reports as a ``RuntimeError``) leaves nothing (False), and the caller says so in the lock file for a
    while. Atomically; best effort."""
    try:
        # Its graph copied into one that names no tracer: torchvision's (which traced it) would be imported to load it.
        graph = fx.Graph()
        output = next(n for n in traced.nodes if n.op == "output")
        graph.output(graph.graph_copy(traced.module.graph, {}), output.type)
        module = fx.GraphModule(traced.module, graph, type(traced.module).__name__)
        size = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        paths = {n.name: p for n, p in zip(traced.nodes, traced.paths, strict=True)}
    except Exception:  # said below
        size = MAX_BYTES + 1
    if size <= MAX_BYTES:
        if not has_room(path.parent, size):
            return False
        try:
            write_private_file(path, lambda f: torch.save({"module": module, "code": module.code, "paths": paths}, f))
        except (OSError, RuntimeError):  # a full disk (torch.save's own writer raises RuntimeError): for now
            return False
        except Exception:  # unpicklable: for good, said below
            pass
        if _load_network(path) is not None:
            return True
    try:
        write_private_file(path, lambda f: None)  # "not kept": the waiters build their own at once
    except OSError:
        return False  # said in the lock file instead, for a while
    return True
