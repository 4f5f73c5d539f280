"""Built stages kept between a block's processes, in the server's private runtime directory.

Building a part means importing torchvision (about 1 s of CPU, most of it ``torch._dynamo``,
which ``torchvision.ops`` pulls in), building the whole network under its seed and tracing it.
A live plan change starts new block processes for blocks that often ran before (a reload, a
second instance, a plan changed back), so the first process to build a part keeps it here and
the next ones load it: a pickled ``GraphModule`` whose code refers to ``torch`` only, unless the
network calls a torchvision function (EfficientNet's stochastic depth), in which case loading it
imports torchvision as building would.

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

import functools
import hashlib
import importlib.util
import json
import os
import stat
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from blockflow.core import env, programs
from blockflow.core.errors import EnvironmentProblem
from blockflow.core.runtime_dir import private_dir
from blockflow.core.spec import ModelSpec, Part
from blockflow.core.trained_weights import trained_weights

FORMAT = 2
# BlockFlow's modules that build a part from its spec: their source is in the key, so a kept part is
# never one that older code built (a directory kept across servers outlives a checkout's commit).
BUILD_CODE = ("blockflow.backend.parts", "blockflow.core.arch", "blockflow.core.cuts", "blockflow.core.folding",
              "blockflow.core.in_place", "blockflow.core.detection", "blockflow.core.programs",
              "blockflow.core.stage_files", "blockflow.core.trained_weights")
# Parts larger than this are not kept: the runtime directory may be in memory (tmpfs).
MAX_BYTES = 512 << 20


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


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class StageCache:
    """Built parts (CPU, fp32, eval mode) in ``directory``, one file per part."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(mode=0o700, exist_ok=True)

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
        key = {"format": FORMAT, "arch": network, "cut_points": spec.cut_points, "num_classes": spec.num_classes,
               "input_shape": spec.input_shape, "first": part.first, "last": part.last, "weights": weights,
               "threads": torch.get_num_threads(), "cpu": torch.backends.cpu.get_cpu_capability(), "code": build_code_digest(), "torch": torch.__version__, "torchvision": _version("torchvision")}
        digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
        return self.directory / f"{digest}.pt"

    def load(self, entry: Path) -> nn.Module | None:
        """The part kept at ``entry`` (:meth:`path`), if it is usable (any problem with it counts as a miss)."""
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return None
            try:
                module = torch.load(f, map_location="cpu", weights_only=False)
            except Exception:  # a truncated or stale entry: build again
                return None
        return module.eval() if isinstance(module, nn.Module) else None

    def store(self, entry: Path, module: nn.Module) -> None:
        """Keep ``module`` at ``entry`` (:meth:`path`, keyed before it was built) for the next process (atomically; best effort)."""
        size = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        if size > MAX_BYTES:
            return
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
        try:
            tmp.unlink(missing_ok=True)  # left by a process of this pid that died while saving
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
                torch.save(module, f)
            os.replace(tmp, entry)
        except BaseException as exc:  # a full disk or an unpicklable module: the next process builds it again
            tmp.unlink(missing_ok=True)
            if not isinstance(exc, Exception):
                raise
