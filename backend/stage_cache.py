"""Built stages kept between a block's processes, in the server's private runtime directory.

Building a part means importing torchvision (about 1 s of CPU, most of it ``torch._dynamo``,
which ``torchvision.ops`` pulls in), building the whole network under its seed and tracing it.
A live plan change starts new block processes for blocks that often ran before (a reload, a
second instance, a plan changed back), so the first process to build a part keeps it here and
the next ones load it: a pickled ``GraphModule`` whose code refers to ``torch`` only, unless the
network calls a torchvision function (EfficientNet's stochastic depth), in which case loading it
imports torchvision as building would.

Entries are keyed by everything that defines the part (network or exported program's bytes,
cuts, stages, the seed or the weights file's bytes, the torch and torchvision versions). The directory is the runtime
directory's (0700, the server's user): what is unpickled here was written by this server's own
block processes, which already run code from the model repository; a file that is not the
user's own, or that others can write, is ignored. User-supplied weights are never unpickled
(``weights_only`` loads, in ``blockflow.backend.runtime``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from blockflow.core import env, programs
from blockflow.core.spec import ModelSpec, Part
from blockflow.core.trained_weights import trained_weights

FORMAT = 1
# Parts larger than this are not kept: the runtime directory may be in memory (tmpfs).
MAX_BYTES = 512 << 20


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


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
    def of_runtime_dir(cls) -> StageCache | None:
        """The server's cache, or None outside a server or when ``BLOCKFLOW_STAGE_CACHE=0``."""
        runtime = os.environ.get(env.RUNTIME_DIR)
        if not runtime or not Path(runtime).is_dir() or os.environ.get(env.STAGE_CACHE) == "0":
            return None
        return cls(Path(runtime) / env.STAGE_CACHE_DIR)

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
               "torch": torch.__version__, "torchvision": _version("torchvision")}
        digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
        return self.directory / f"{digest}.pt"

    def load(self, spec: ModelSpec, part: Part) -> nn.Module | None:
        """The part, if a usable entry exists (any problem with one counts as a miss)."""
        path = self.path(spec, part)
        try:
            st = path.stat()
        except OSError:
            return None
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        try:
            module = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # a truncated or stale entry: build again
            return None
        return module.eval() if isinstance(module, nn.Module) else None

    def store(self, spec: ModelSpec, part: Part, module: nn.Module) -> None:
        """Keep ``module`` for the next process (atomically; best effort)."""
        size = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        if size > MAX_BYTES:
            return
        path = self.path(spec, part)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                torch.save(module, f)
            os.replace(tmp, path)
        except Exception:  # a full disk or an unpicklable module: the next process builds it again
            tmp.unlink(missing_ok=True)
