"""Plans: which blocks exist, where they run, and which path each task takes.

A plan is YAML (or JSON) with ``version: 1``. :func:`load_plan` parses it,
checks every field (unknown keys are refused) and then the whole graph, and
raises one :class:`~blockflow.errors.PlanError` listing every problem with its
key path, the bad value and the fix. See ``docs/plan.md`` for the format.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from blockflow import arch as archs
from blockflow.errors import PlanError, PlanIssue
from blockflow.spec import Precision, TensorMQSettings, TransportName, WeightsSource

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
NAME_RULE = "start with a letter; letters, digits, '_' and '-' only; at most 64 characters; no '__' (reserved for generated variants)"

Placement = Literal["auto", "cpu", "gpu"] | list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelDef(_Strict):
    """A base network: its torchvision architecture and where it is cut."""

    arch: str
    cut_points: list[str] = Field(default_factory=list)
    input_shape: list[int] = Field(default_factory=lambda: [3, 224, 224])
    num_classes: int = Field(default=1000, ge=1, le=100_000)

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str) -> str:
        if v not in archs.SUPPORTED_ARCHS:
            raise ValueError(f"unknown architecture {v!r}; use one of {', '.join(archs.SUPPORTED_ARCHS)}")
        return v

    @field_validator("input_shape")
    @classmethod
    def _sane_input(cls, v: list[int]) -> list[int]:
        if len(v) != 3 or v[0] != 3 or not (32 <= v[1] <= 4096 and 32 <= v[2] <= 4096):
            raise ValueError(f"input_shape {list(v)} is not [3, H, W] with 32 <= H, W <= 4096")
        return v

    @property
    def stage_count(self) -> int:
        return len(self.cut_points) + 1


class Weights(_Strict):
    """Exactly one of ``seed`` (deterministic random weights) or ``file`` (a state dict)."""

    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    file: str | None = None


class BlockSettings(_Strict):
    """Settings a block may set and ``defaults`` may set for all blocks."""

    placement: Placement | None = None
    instances: int | None = Field(default=None, ge=1, le=64)
    max_batch_size: int | None = Field(default=None, ge=1, le=1024)
    batching_delay_us: int | None = Field(default=None, ge=0, le=1_000_000)
    precision: Precision | None = None
    cuda_graphs: bool | None = None
    # Seconds between the block monitor's samples (GPU/CPU memory, utilisation, power); 0 turns it off.
    monitor_period_s: float | None = Field(default=None, ge=0, le=3600)


DEFAULT_SETTINGS: dict[str, Any] = {
    "placement": "auto",
    "instances": 1,
    "max_batch_size": 8,
    "batching_delay_us": 100,
    "precision": "fp32",
    "cuda_graphs": True,
    "monitor_period_s": 2.0,
}


class BlockDef(BlockSettings):
    """A block: a contiguous stage range of one model, with its own weights."""

    model: str
    stages: int | tuple[int, int]
    weights: Weights = Weights(seed=0)


class TaskDef(_Strict):
    """A task: the path of blocks its requests take, first stage to last."""

    path: list[str] = Field(min_length=1)
    transport: TransportName | None = None


class PlanModel(_Strict):
    """The plan as written (fields checked, graph not yet)."""

    version: Literal[1]
    name: str = "blockflow"
    models: dict[str, ModelDef] = Field(min_length=1)
    defaults: BlockSettings = BlockSettings()
    blocks: dict[str, BlockDef] = Field(min_length=1)
    tasks: dict[str, TaskDef] = Field(min_length=1)
    transport: TransportName = "tensormq"
    compare: list[TransportName] = Field(default_factory=list)
    references: list[Literal["eager", "graph"]] = Field(default_factory=list)
    # auto: consecutive blocks that exactly the same tasks traverse (with the same deployment
    # settings) run as one model: one process and one hop fewer per fused pair.
    fuse: Literal["none", "auto"] = "none"
    # heads: the heads of tasks that branch off after the same deployed block (each the last,
    # task-specific part of its path) run as one model: one process for all of them.
    pack: Literal["none", "heads"] = "none"
    tensormq: TensorMQSettings = TensorMQSettings()


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


@dataclass(frozen=True)
class Task:
    name: str
    path: tuple[str, ...]
    transport: TransportName


@dataclass(frozen=True)
class HeadPack:
    """Task heads that run as one model (``pack: heads``): one process instead of one per head.

    A task's *head* is the last deployed segment of its path when no other task uses any of
    its blocks. Heads that follow the same deployed segment, on the same transport and with the
    same deployment settings, form one pack; the pack answers each task on its own output.
    """

    name: str  # the pack's segment name, e.g. ``trunk__heads`` (before any transport suffix)
    after: str  # the deployed segment every head takes its input from
    tasks: tuple[str, ...]
    heads: tuple[tuple[Block, ...], ...]  # each task's head segment, in ``tasks`` order


@dataclass(frozen=True)
class Deployed:
    """One Triton model on a task's path: its name (before any transport suffix), the task's
    blocks in it and, for a packed head, the pack it runs in."""

    name: str
    blocks: tuple[Block, ...]
    pack: HeadPack | None = None


class Plan:
    """A validated plan. Build it with :func:`load_plan` or :func:`parse_plan`."""

    def __init__(self, raw: PlanModel, source: str = "", base_dir: Path | None = None,
                 weights_dirs: Sequence[Path] | None = None) -> None:
        self.raw = raw
        self.source = source
        self.base_dir = base_dir or Path.cwd()
        # Where weights files may come from (None: anywhere this user can read; a plan file of one's own).
        self.weights_dirs = None if weights_dirs is None else [d.resolve() for d in weights_dirs]

    @property
    def models(self) -> Mapping[str, ModelDef]:
        return self.raw.models

    @cached_property
    def blocks(self) -> dict[str, Block]:
        return {name: _resolve_block(name, b, self.raw.defaults, self.base_dir) for name, b in self.raw.blocks.items()}

    @cached_property
    def tasks(self) -> dict[str, Task]:
        return {
            name: Task(name, tuple(t.path), t.transport or self.raw.transport) for name, t in self.raw.tasks.items()
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
        named after its pack; ``ensemble_gen.naming.block_model`` adds any transport suffix)."""
        from ensemble_gen import naming

        out = [Deployed(naming.segment_model([b.name for b in seg]), seg) for seg in self.segments(task)]
        pack = self.head_packs.get(task.name)
        if pack is not None:
            out[-1] = Deployed(pack.name, out[-1].blocks, pack)
        return out

    @cached_property
    def head_packs(self) -> dict[str, HeadPack]:
        """Task name -> the head pack its head runs in (empty unless ``pack: heads``)."""
        if self.raw.pack != "heads":
            return {}
        from ensemble_gen import naming

        users = self.sharing()
        groups: dict[tuple[Any, ...], list[tuple[str, tuple[Block, ...]]]] = {}
        for task in self.tasks.values():
            segments = self.segments(task)
            head = segments[-1]
            if len(segments) < 2 or any(users[b.name] != [task.name] for b in head):
                continue
            after = naming.segment_model([b.name for b in segments[-2]])
            first = head[0]
            key = (after, task.transport, first.model, first.placement, first.instances, first.max_batch_size,
                   first.precision, first.cuda_graphs)
            groups.setdefault(key, []).append((task.name, head))
        out: dict[str, HeadPack] = {}
        named: dict[str, int] = {}
        for key, members in groups.items():
            if len(members) < 2:
                continue  # a lone head stays a model of its own
            after = str(key[0])
            named[after] = named.get(after, 0) + 1
            pack = HeadPack(naming.head_pack(after, named[after]), after, tuple(t for t, _ in members),
                            tuple(h for _, h in members))
            out.update(dict.fromkeys(pack.tasks, pack))
        return out

    def sharing(self) -> dict[str, list[str]]:
        """Block name -> the tasks whose path uses it."""
        users: dict[str, list[str]] = {b: [] for b in self.blocks}
        for t in self.tasks.values():
            for b in t.path:
                users[b].append(t.name)
        return users

    @cached_property
    def stage_shapes(self) -> dict[str, list[tuple[int, ...]]]:
        """Model name -> per-sample output shape of each of its stages (meta-device inference)."""
        return {
            name: archs.stage_output_shapes(m.arch, m.cut_points, m.input_shape, m.num_classes)
            for name, m in self.models.items()
        }

    def block_in_shape(self, block: Block) -> tuple[int, ...]:
        if block.first == 0:
            return tuple(self.models[block.model].input_shape)
        return self.stage_shapes[block.model][block.first - 1]

    def block_out_shape(self, block: Block) -> tuple[int, ...]:
        return self.stage_shapes[block.model][block.last]

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
        if self.raw.pack == "heads" and not self.head_packs:
            out.append("pack: 'heads' packs nothing: no two tasks have heads of their own after the same block "
                       "with the same deployment settings")
        return out


def _deployed_alike(a: Block, b: Block) -> bool:
    """Whether two blocks can share one process (fusion keeps the first one's batching and monitor settings)."""
    return (a.model == b.model and a.placement == b.placement and a.instances == b.instances
            and a.max_batch_size == b.max_batch_size and a.precision == b.precision and a.cuda_graphs == b.cuda_graphs)


def _resolve_block(name: str, b: BlockDef, defaults: BlockSettings, base_dir: Path) -> Block:
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
    file = b.weights.file
    if file is not None:
        file = str((base_dir / file).resolve())
    return Block(
        name=name,
        model=b.model,
        first=first,
        last=last,
        weights=WeightsSource(seed=b.weights.seed if file is None else None, file=file),
        placement=placement,
        instances=pick("instances"),
        max_batch_size=pick("max_batch_size"),
        batching_delay_us=pick("batching_delay_us"),
        precision=pick("precision"),
        cuda_graphs=pick("cuda_graphs"),
        monitor_period_s=pick("monitor_period_s"),
    )


# --------------------------------------------------------------------------- loading


def load_plan(path: str | Path) -> Plan:
    """Read, parse and fully validate the plan file at ``path``."""
    p = Path(path)
    if not p.is_file():
        raise PlanError([PlanIssue("", f"plan file not found: {p} (give an existing YAML or JSON file)")], str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError([PlanIssue("", f"not valid YAML/JSON: {exc}")], str(p)) from None
    return parse_plan_text(text, source=str(p), base_dir=p.parent.resolve())


class _PlanLoader(yaml.SafeLoader):
    """YAML without aliases: a plan has no use for them, and nested aliases expand exponentially
    (a 1 kB "billion laughs" document is a billion nodes to validate)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not allowed in a plan", event.start_mark)
        return super().compose_node(parent, index)


def parse_plan_text(text: str, source: str = "", base_dir: Path | None = None,
                    weights_dirs: Sequence[Path] | None = None) -> Plan:
    """Parse and fully validate a plan given as YAML or JSON text (JSON is YAML)."""
    try:
        data = yaml.load(text, Loader=_PlanLoader)  # noqa: S506 - a SafeLoader that also refuses aliases
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise PlanError([PlanIssue("", f"not valid YAML/JSON{at}: {getattr(exc, 'problem', exc)}")], source) from None
    except RecursionError:
        raise PlanError([PlanIssue("", "not a plan: nested too deeply")], source) from None
    return parse_plan(data, source=source, base_dir=base_dir, weights_dirs=weights_dirs)


def parse_plan(data: object, source: str = "", base_dir: Path | None = None,
               weights_dirs: Sequence[Path] | None = None) -> Plan:
    """Validate plan data already loaded from YAML/JSON."""
    if not isinstance(data, dict):
        raise PlanError([PlanIssue("", f"a plan is a mapping with keys version, models, blocks, tasks; got {type(data).__name__}")], source)
    try:
        raw = PlanModel.model_validate(data)
    except ValidationError as exc:
        raise PlanError(_pydantic_issues(exc), source) from None
    except RecursionError:
        raise PlanError([PlanIssue("", "not a plan: nested too deeply")], source) from None
    plan = Plan(raw, source, base_dir, weights_dirs)
    issues = list(_graph_issues(plan))
    if issues:
        raise PlanError(issues, source)
    return plan


def _loc(parts: Iterable[int | str]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_MODEL_FIELDS: dict[str, type[BaseModel]] = {
    "": PlanModel,
    "models": ModelDef,
    "blocks": BlockDef,
    "tasks": TaskDef,
    "defaults": BlockSettings,
    "weights": Weights,
    "tensormq": TensorMQSettings,
}


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    """Keys allowed at the mapping that holds ``loc``'s last element."""
    parent = loc[:-1]
    if not parent:
        return list(PlanModel.model_fields)
    if parent[0] in ("models", "blocks", "tasks") and len(parent) == 2:
        return list(_MODEL_FIELDS[str(parent[0])].model_fields)
    if parent[-1] in _MODEL_FIELDS:
        return list(_MODEL_FIELDS[str(parent[-1])].model_fields)
    return []


def _pydantic_issues(exc: ValidationError) -> list[PlanIssue]:
    issues: list[PlanIssue] = []
    for err in exc.errors():
        # Drop pydantic's union-branch tags (e.g. 'int', 'tuple[int,int]', 'list[int]') from the path.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("int", "str", "bool"))))
        kind = err["type"]
        value = err.get("input")
        if kind == "extra_forbidden":
            key = str(loc[-1])
            allowed = _allowed_keys(loc)
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            msg = f"unknown key {key!r}; {hint}allowed keys: {', '.join(allowed)}"
        elif kind == "missing":
            msg = "required key is missing; add it"
        elif kind == "literal_error":
            msg = f"{value!r} is not allowed; use {err['ctx']['expected']}"
        else:
            msg = f"{err['msg']} (got {value!r})" if kind != "value_error" else str(err["ctx"]["error"])
        issues.append(PlanIssue(_loc(loc), msg))
    # One problem per key path: union branches repeat the same complaint.
    unique: dict[str, PlanIssue] = {}
    for issue in issues:
        unique.setdefault(issue.loc, issue)
    return list(unique.values())


# --------------------------------------------------------------------------- graph checks


def _name_issue(loc: str, name: str) -> PlanIssue | None:
    if NAME_RE.match(name) and "__" not in name:
        return None
    return PlanIssue(loc, f"invalid name {name!r}: {NAME_RULE}")


def _graph_issues(plan: Plan) -> Iterable[PlanIssue]:
    raw = plan.raw
    for section in ("models", "blocks", "tasks"):
        for name in getattr(raw, section):
            issue = _name_issue(f"{section}.{name}", name)
            if issue:
                yield issue
    clash = set(raw.blocks) & set(raw.tasks)
    for name in sorted(clash):
        yield PlanIssue(f"tasks.{name}", f"task name {name!r} is also a block name; Triton model names must be unique, rename one")

    good_models: set[str] = set()
    for name, m in raw.models.items():
        seq = archs.module_sequence(m.arch)
        ok = True
        prev = -1
        for i, cut in enumerate(m.cut_points):
            loc = f"models.{name}.cut_points[{i}]"
            if cut not in seq[:-1]:
                near = difflib.get_close_matches(cut, seq, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                yield PlanIssue(loc, f"{cut!r} is not a module of {m.arch} that a cut can follow{hint}; use one of {', '.join(seq[:-1])}")
                ok = False
                continue
            idx = seq.index(cut)
            if idx <= prev:
                yield PlanIssue(loc, f"{cut!r} does not come after {m.cut_points[i - 1]!r}; list cut points in network order without repeats")
                ok = False
            prev = idx
        if ok:
            good_models.add(name)

    good_blocks: set[str] = set()
    for name, b in raw.blocks.items():
        loc = f"blocks.{name}"
        if b.model not in raw.models:
            yield PlanIssue(f"{loc}.model", f"unknown model {b.model!r}; define it under models or use one of {', '.join(raw.models)}")
            continue
        n = raw.models[b.model].stage_count
        first, last = (b.stages, b.stages) if isinstance(b.stages, int) else b.stages
        if not (0 <= first <= last < n):
            yield PlanIssue(f"{loc}.stages", f"{b.stages!r} is not a stage or [first, last] range within 0..{n - 1} of model {b.model!r}")
            continue
        if b.weights.seed is None and b.weights.file is None:
            yield PlanIssue(f"{loc}.weights", "give exactly one of seed or file")
            continue
        if b.weights.seed is not None and b.weights.file is not None:
            yield PlanIssue(f"{loc}.weights", "give exactly one of seed or file, not both")
            continue
        if b.weights.file is not None:
            # Resolved (links followed) before the check, so '..' or a link cannot leave the allowed directories.
            file = (plan.base_dir / b.weights.file).resolve()
            allowed = plan.weights_dirs
            if allowed is not None and not any(file.is_relative_to(d) for d in allowed):
                yield PlanIssue(f"{loc}.weights.file", f"{b.weights.file!r} is outside the directories this server reads "
                                f"weights from ({', '.join(map(str, allowed))}); put the file there, or start "
                                "`blockflow serve` with --weights-dir naming its directory")
                continue
            if not file.is_file():
                yield PlanIssue(f"{loc}.weights.file", f"file not found: {plan.base_dir / b.weights.file} (paths are relative to the plan file)")
                continue
        if b.model in good_models:
            good_blocks.add(name)
    for where, settings in [("defaults", raw.defaults), *((f"blocks.{n}", b) for n, b in raw.blocks.items())]:
        pl = settings.placement
        if isinstance(pl, list):
            if not pl:
                yield PlanIssue(f"{where}.placement", "empty GPU list; give GPU indices like [0, 1], or 'auto', 'cpu' or 'gpu'")
            elif len(set(pl)) != len(pl) or min(pl) < 0:
                yield PlanIssue(f"{where}.placement", f"{pl} must list distinct GPU indices >= 0")

    for tname, task in raw.tasks.items():
        yield from _path_issues(plan, tname, task, good_blocks)


def _path_issues(plan: Plan, tname: str, task: TaskDef, good_blocks: set[str]) -> Iterable[PlanIssue]:
    raw = plan.raw
    prev: BlockDef | None = None
    prev_name = ""
    for i, bname in enumerate(task.path):
        loc = f"tasks.{tname}.path[{i}]"
        if bname not in raw.blocks:
            near = difflib.get_close_matches(bname, list(raw.blocks), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            yield PlanIssue(loc, f"unknown block {bname!r}{hint}; define it under blocks")
            return
        if bname not in good_blocks:
            return  # the block's own problem is already reported
        block = plan.blocks[bname]
        expected = 0 if prev is None else plan.blocks[prev_name].last + 1
        if block.first != expected:
            covers = f"stage {block.first}" if block.first == block.last else f"stages {block.first}-{block.last}"
            yield PlanIssue(loc, f"block {bname!r} covers {covers} but stage {expected} is expected here; "
                                 f"a path covers its model's stages in order from 0 to the last, each once")
            return
        if prev is not None:
            pb = plan.blocks[prev_name]
            out = plan.block_out_shape(pb)
            inp = plan.block_in_shape(block)
            if out != inp:
                yield PlanIssue(loc, f"block {bname!r} takes {list(inp)} but {prev_name!r} gives {list(out)}; "
                                     "use blocks of models whose shapes match at this cut")
                return
        prev, prev_name = raw.blocks[bname], bname
    if prev is not None:
        last_block = plan.blocks[prev_name]
        n = raw.models[last_block.model].stage_count
        if last_block.last != n - 1:
            yield PlanIssue(f"tasks.{tname}.path", f"path ends at stage {last_block.last} but model {last_block.model!r} "
                                                   f"has stages 0..{n - 1}; add blocks up to stage {n - 1}")
        nets = {(m.arch, tuple(m.cut_points), tuple(m.input_shape), m.num_classes)
                for m in (raw.models[plan.blocks[b].model] for b in task.path)}
        if len(nets) > 1:
            # Shapes matched, but the monolithic reference runs the whole path as one network.
            yield PlanIssue(f"tasks.{tname}.path", "blocks of one path must come from models with the same arch, "
                                                   "cut_points, input_shape and num_classes; use one model definition")
