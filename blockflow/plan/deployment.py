"""A validated plan: its blocks with every setting resolved, its tasks, and how they deploy
(fusion of consecutive blocks, packs of heads (``blockflow.plan.packs``), the model each deployed
unit becomes, the task inputs besides the image each reads (``blockflow.plan.side_inputs``))."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from blockflow.core import arch as archs
from blockflow.core import stage_files
from blockflow.core.errors import PlanError, PlanIssue
from blockflow.core.spec import HopDtype, Precision, TaskOutput, TransportName, WeightsSource, hop_dtype
from blockflow.core.trained_weights import trained_weights
from blockflow.plan import naming
from blockflow.plan.hand_overs import HandOvers
from blockflow.plan.packs import HeadPack, head_packs
from blockflow.plan.schema import (
    DEFAULT_SETTINGS,
    BlockDef,
    BlockSettings,
    HandOverMode,
    ModelDef,
    PlanModel,
)
from blockflow.plan.side_inputs import SideInputs


@dataclass(frozen=True)
class Block:
    """A block with every setting resolved (its own, else ``defaults``, else built-in)."""

    name: str
    model: str
    first: int
    last: int
    weights: WeightsSource
    placement: Literal["auto", "cpu", "gpu"] | tuple[int, ...]
    instances: int
    max_batch_size: int
    batching_delay_us: int
    precision: Precision
    cuda_graphs: bool
    monitor_period_s: float = 2.0
    dynamic_batching: bool = True


@dataclass(frozen=True)
class Task:
    name: str
    path: tuple[str, ...]
    transport: TransportName
    hand_over: HandOverMode = "ensemble"


@dataclass(frozen=True)
class Deployed:
    """One Triton model on a task's path: its name (before any transport suffix), the task's
    blocks in it and, for a packed head, the pack it runs in."""

    name: str
    blocks: tuple[Block, ...]
    pack: HeadPack | None = None


class Plan(SideInputs, HandOvers):
    """A validated plan. Build it with :func:`load_plan` or :func:`parse_plan`; its side inputs
    (task inputs besides the image) come from :class:`blockflow.plan.side_inputs.SideInputs`."""

    def __init__(self, raw: PlanModel, source: str = "", base_dir: Path | None = None,
                 weights_dirs: Sequence[Path] | None = None) -> None:
        self.raw = raw
        self.source = source
        self.base_dir = base_dir or Path.cwd()
        # Where weights files may come from (None: anywhere this user can read; a plan file of one's own).
        self.weights_dirs = None if weights_dirs is None else [d.resolve() for d in weights_dirs]
        # Which of the plan's ``servers`` this process serves (None: a plan of one server).
        self.server: str | None = None

    def on_server(self, server: str | None) -> Plan:
        """This plan as the server ``server`` of its ``servers`` serves it (its part: ``blockflow.plan.crossing``)."""
        if server is not None and server not in self.raw.servers:
            known = ", ".join(self.raw.servers) or "none: the plan runs on one server"
            raise PlanError([PlanIssue("servers", f"no server {server!r} (the plan's servers: {known})")], self.source)
        view = copy.copy(self)
        view.server = server
        return view

    @cached_property
    def models(self) -> Mapping[str, ModelDef]:
        """The plan's models; an exported program's with its absolute path as ``arch`` and the input
        shape and classes it was exported with."""
        return {name: self._resolved(m) for name, m in self.raw.models.items()}

    def file_path(self, written: str) -> Path:
        """Where a file the plan names is (links followed: the allowed-directory check needs the real path)."""
        return (self.base_dir / written).resolve()

    def allows(self, path: Path) -> bool:
        """Whether ``path`` (resolved) is in the directories this plan may read files from."""
        return self.weights_dirs is None or any(path.is_relative_to(d) for d in self.weights_dirs)

    def readable(self, path: Path) -> bool:
        """Whether ``path`` is a regular file in the directories this plan may read from."""
        return self.allows(path) and path.is_file()

    def _resolved(self, m: ModelDef) -> ModelDef:
        if m.stage_files is not None:
            files = [self.file_path(f) for f in m.stage_files]
            if not all(map(self.readable, files)):  # never read: the checks say why
                return m
            given = m.input_shape if "input_shape" in m.model_fields_set else None
            try:
                shapes = stage_files.stage_file_shapes([str(f) for f in files], given)
            except ValueError:
                return m  # the checks report why it cannot be served
            return m.model_copy(update={"stage_files": [str(f) for f in files], "input_shape": list(shapes[0][0][0]),
                                        "num_classes": math.prod(shapes[-1][1][0])})
        if m.program is None:
            return m
        path = self.file_path(str(m.program))
        if not self.readable(path):  # never read: the checks say why
            return m.model_copy(update={"arch": str(path)})
        try:
            cuts = archs.legal_cuts(str(path), (), 0)
        except ValueError:
            return m.model_copy(update={"arch": str(path)})  # the checks report why it cannot be served
        return m.model_copy(update={"arch": str(path), "input_shape": list(cuts.input_shape),
                                    "num_classes": math.prod(cuts.output_shape)})

    @cached_property
    def blocks(self) -> dict[str, Block]:
        return {name: _resolve_block(name, b, self.raw.defaults, self.base_dir, self.raw.models.get(b.model))
                for name, b in self.raw.blocks.items()}

    @cached_property
    def tasks(self) -> dict[str, Task]:
        return {
            name: Task(name, tuple(t.path), t.transport or self.raw.transport, t.hand_over or self.raw.hand_over) for name, t in self.raw.tasks.items()
        }

    @property
    def transport(self) -> TransportName:
        return self.raw.transport

    def transports_of(self, task: Task) -> list[TransportName]:
        """The task's own transport first, then the ``compare`` variants (no repeats)."""
        return list(dict.fromkeys([task.transport, *self.raw.compare]))

    def used_blocks(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.tasks.values():
            seen.update(dict.fromkeys(t.path))
        return list(seen)

    def segments(self, task: Task) -> list[tuple[Block, ...]]:
        """``task``'s path as deployed: one tuple per Triton model (several blocks when fused)."""
        users = {b: frozenset(ts) for b, ts in self.sharing().items()}
        out: list[tuple[Block, ...]] = []
        for name in task.path:
            b = self.blocks[name]
            if out and self.raw.fuse == "auto":
                prev = out[-1][-1]
                if users[prev.name] == users[name] and _deployed_alike(prev, b):
                    out[-1] = out[-1] + (b,)
                    continue
            out.append((b,))
        return out

    def deployed(self, task: Task) -> list[Deployed]:
        """``task``'s path as Triton models, one :class:`Deployed` per model (a packed head is
        named after its pack; ``blockflow.plan.naming.block_model`` adds any transport suffix)."""

        out = [Deployed(naming.segment_model([b.name for b in seg]), seg) for seg in self.segments(task)]
        pack = self.head_packs.get(task.name)
        if pack is not None:
            out[-1] = Deployed(pack.name, out[-1].blocks, pack)
        return out

    @cached_property
    def head_packs(self) -> dict[str, HeadPack]:
        """Task name -> the pack its head (with ``pack: all``, or its whole model) runs in (empty
        with ``pack: none``): :func:`blockflow.plan.packs.head_packs`."""
        return head_packs(self)

    def sharing(self) -> dict[str, list[str]]:
        """Block name -> the tasks whose path uses it."""
        users: dict[str, list[str]] = {b: [] for b in self.blocks}
        for t in self.tasks.values():
            for b in t.path:
                users[b].append(t.name)
        return users

    @cached_property
    def stage_shapes(self) -> dict[str, list[tuple[tuple[int, ...], ...]]]:
        """Model name -> per-sample shapes of the tensors each of its stages gives (meta-device inference)."""
        return {name: self._stage_shapes(m) for name, m in self.models.items()}

    @staticmethod
    def _stage_shapes(m: ModelDef) -> list[tuple[tuple[int, ...], ...]]:
        if m.stage_files is not None:
            return [outs for _, outs in stage_files.stage_file_shapes(m.stage_files, m.input_shape)]
        return archs.stage_output_shapes(m.network, m.cut_points, m.input_shape, m.num_classes)

    def block_in_shapes(self, block: Block) -> tuple[tuple[int, ...], ...]:
        """Per-sample shapes of the tensors ``block`` takes (the image, or what crosses its cut)."""
        if block.first == 0:
            return (tuple(self.models[block.model].input_shape),)
        return self.stage_shapes[block.model][block.first - 1]

    def block_out_shapes(self, block: Block) -> tuple[tuple[int, ...], ...]:
        return self.stage_shapes[block.model][block.last]

    def block_feeders(self, block: Block) -> dict[str, HopDtype]:
        """The blocks right before ``block`` on some task's path, with the dtype each hands on."""
        out: dict[str, HopDtype] = {}
        for t in self.tasks.values():
            for before, name in zip(t.path, t.path[1:], strict=False):
                if name == block.name and before in self.blocks:
                    out[before] = hop_dtype(self.blocks[before].precision)
        return out

    def task_precision(self, task: Task) -> Precision:
        """The precision every block of ``task``'s path runs in; fp32 when they differ (no one
        precision to match), which is the precision of the task's monolithic references."""
        kinds = {self.blocks[b].precision for b in task.path}
        return kinds.pop() if len(kinds) == 1 else "fp32"

    def precision_label(self, task: Task) -> str:
        """What ``task``'s blocks run in, for reports: the one precision, or each block's where they differ
        (``mixed: stem fp16, head fp32``; its monolithic references run each part in its block's precision)."""
        kinds = {self.blocks[b].precision for b in task.path}
        if len(kinds) == 1:
            return kinds.pop()
        return "mixed: " + ", ".join(f"{b} {self.blocks[b].precision}" for b in task.path)

    def reference_variants(self, task: Task) -> list[tuple[bool, bool]]:
        """(CUDA graphs, fp32) of each monolithic reference generated for ``task``: one per
        ``references`` variant, each part in its block's precision, and the eager fp32 one when any
        block runs in another."""
        variants = [(v == "graph", False) for v in self.raw.references]
        if self.raw.references and any(self.blocks[b].precision != "fp32" for b in task.path):
            variants.append((False, True))
        return variants

    def reference_models(self, task: Task) -> list[str]:
        """The names of :meth:`reference_variants`' models."""
        return [naming.fp32_reference(task.name) if fp32 else naming.reference_model(task.name, graph)
                for graph, fp32 in self.reference_variants(task)]

    def block_in_dtype(self, block: Block) -> HopDtype:
        """The dtype of the hop into ``block``: the precision of the block before it (the checks
        make every path agree)."""
        return next(iter(self.block_feeders(block).values()), "fp32")

    def block_in_shape(self, block: Block) -> tuple[int, ...]:
        """The first (for most cuts, the only) tensor ``block`` takes."""
        return self.block_in_shapes(block)[0]

    def block_out_shape(self, block: Block) -> tuple[int, ...]:
        return self.block_out_shapes(block)[0]

    def block_outputs(self, block: Block) -> tuple[TaskOutput, ...]:
        """What ``block`` answers its tasks with where it ends its network and that is a detector's
        (``blockflow.core.detection``); empty where it answers LOGITS or hands on."""
        m = self.models[block.model]
        if block.last != m.stage_count - 1 or m.stage_files is not None:
            return ()
        return archs.task_outputs(m.network, m.input_shape)

    def device_issues(self, gpus: int) -> list[PlanIssue]:
        """Placement problems on a machine with ``gpus`` visible GPUs (checked when serving)."""
        issues = []
        for name in self.used_blocks():
            b = self.blocks[name]
            if b.placement == "gpu" and gpus == 0:
                issues.append(PlanIssue(f"blocks.{name}.placement", "'gpu' but this machine has no GPU; use 'auto' or 'cpu'"))
            elif isinstance(b.placement, tuple) and max(b.placement) >= gpus:
                have = f"GPUs 0..{gpus - 1}" if gpus else "no GPU"
                issues.append(PlanIssue(f"blocks.{name}.placement", f"GPU {max(b.placement)} does not exist (this machine has {have}); "
                                                                    "use existing indices, 'auto' or 'cpu'"))
        return issues

    def warnings(self) -> list[str]:
        used = set(self.used_blocks())
        out = [f"blocks.{b}: no task uses this block; it is not deployed" for b in self.blocks if b not in used]
        for name, sharing in self.sharing().items():
            if not self.blocks[name].dynamic_batching and len(sharing) > 1:
                out.append(f"blocks.{name}: dynamic_batching is off, so requests of its {len(sharing)} tasks "
                           f"({', '.join(sharing)}) never share an execute; under load it runs them one by one")
        out += self.hand_over_warnings()
        if self.raw.pack == "heads" and not self.head_packs:
            out.append("pack: 'heads' packs nothing: no two tasks have heads of their own after the same block "
                       "with the same deployment settings")
        elif self.raw.pack == "all" and not self.head_packs:
            out.append("pack: 'all' packs nothing: no two tasks have heads of their own after the same block, nor "
                       "whole models of their own (one deployed model each, no block shared) of the same model, "
                       "with the same deployment settings")
        if self.raw.reference_instances is not None and not self.raw.references:
            out.append("reference_instances has no effect without references")
        # A dumped plan repeats the default, so only a value other than it is worth a warning.
        if self.raw.pack == "none" and self.raw.pack_size != type(self.raw).model_fields["pack_size"].default:
            out.append("pack_size has no effect with pack: 'none'")
        return out


def _deployed_alike(a: Block, b: Block) -> bool:
    """Whether two blocks can share one process (fusion keeps the first one's batching and monitor settings)."""
    return (a.model == b.model and a.placement == b.placement and a.instances == b.instances
            and a.max_batch_size == b.max_batch_size and a.precision == b.precision and a.cuda_graphs == b.cuda_graphs)


def _resolve_block(name: str, b: BlockDef, defaults: BlockSettings, base_dir: Path, model: ModelDef | None) -> Block:
    def pick(key: str) -> Any:
        own = getattr(b, key)
        if own is not None:
            return own
        dflt = getattr(defaults, key)
        return dflt if dflt is not None else DEFAULT_SETTINGS[key]

    first, last = (b.stages, b.stages) if isinstance(b.stages, int) else b.stages
    placement = pick("placement")
    if isinstance(placement, list):
        placement = tuple(placement)
    if b.weights is None:  # seed 0, or an exported program's or stage file's own weights
        own = model is not None and (model.program is not None or model.stage_files is not None)
        weights = WeightsSource(seed=None if own else 0)
    elif b.weights.file is not None:
        weights = WeightsSource(file=str((base_dir / b.weights.file).resolve()))
    elif b.weights.torchvision is not None and model is not None and model.arch is not None:
        # The canonical name (DEFAULT is an alias): what the block's digest and stage cache key on. A name
        # torchvision does not know stays as written; the plan's checks report it.
        try:
            weights = WeightsSource(torchvision=trained_weights(model.arch, b.weights.torchvision).name)
        except ValueError:
            weights = WeightsSource(torchvision=b.weights.torchvision)
    else:
        weights = WeightsSource(seed=b.weights.seed)
    return Block(
        name=name,
        model=b.model,
        first=first,
        last=last,
        weights=weights,
        placement=placement,
        instances=pick("instances"),
        max_batch_size=pick("max_batch_size"),
        batching_delay_us=pick("batching_delay_us"),
        precision=pick("precision"),
        cuda_graphs=pick("cuda_graphs"),
        monitor_period_s=pick("monitor_period_s"),
        dynamic_batching=pick("dynamic_batching"),
    )

