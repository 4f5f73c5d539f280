"""The checks that need the whole plan: names, models and cuts, block graphs, task paths."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

from blockflow.core import arch as archs
from blockflow.core import detection, stage_files
from blockflow.core.errors import PlanIssue
from blockflow.core.spec import LOGITS, SideInput
from blockflow.core.trained_weights import trained_weights
from blockflow.plan import crossing
from blockflow.plan.deployment import Plan
from blockflow.plan.schema import NAME_RE, NAME_RULE, BlockDef, ModelDef, TaskDef


def _name_issue(loc: str, name: str) -> PlanIssue | None:
    if NAME_RE.match(name) and "__" not in name:
        return None
    return PlanIssue(loc, f"invalid name {name!r}: {NAME_RULE}")


def graph_issues(plan: Plan) -> Iterable[PlanIssue]:
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
    for name, written in raw.models.items():
        m = plan.models[name]
        if written.stage_files is not None:
            issues = list(_stage_file_issues(plan, name, written))
            yield from issues
            if not issues:
                good_models.add(name)
            continue
        if written.program is not None:
            issue = _file_issue(plan, f"models.{name}.program", written.program, "programs")
            if issue:
                yield issue
                continue
        try:
            cuts = archs.legal_cuts(m.network, tuple(m.input_shape), m.num_classes)
        except ValueError as exc:
            if written.program is not None:
                yield PlanIssue(f"models.{name}.program", str(exc))
            else:
                yield PlanIssue(f"models.{name}.input_shape", f"{exc}; give an input_shape the network takes")
            continue
        shown = written.arch or written.program
        names = cuts.names()
        ok = True
        prev = -1
        for i, cut in enumerate(m.cut_points):
            loc = f"models.{name}.cut_points[{i}]"
            if cut not in names:
                near = difflib.get_close_matches(cut, names, n=3)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                yield PlanIssue(loc, f"{cut!r} is not a place where {shown} can be cut{hint}; a cut is a module path or "
                                     f"node after which at most {archs.MAX_HOP_TENSORS} tensors go on, each with the batch "
                                     f"first: `blockflow show --cuts {shown}` lists them")
                ok = False
                continue
            idx = cuts.position(cut)
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
        weights = b.weights
        program = raw.models[b.model].program is not None
        if raw.models[b.model].stage_files is not None and weights is not None:
            yield PlanIssue(f"{loc}.weights", f"model {b.model!r} is cut into stage files, which carry their own weights; "
                                              "leave weights out")
            continue
        given = [] if weights is None else [k for k in ("seed", "file", "torchvision") if getattr(weights, k) is not None]
        if weights is not None and len(given) != 1:
            yield PlanIssue(f"{loc}.weights", "give exactly one of seed, file or torchvision" +
                            (f", not {' and '.join(given)}" if given else ", or leave weights out for the program's own" if program else ""))
            continue
        if weights is not None and weights.torchvision is not None:
            issue = torchvision_weights_issue(f"{loc}.weights.torchvision", raw.models[b.model], weights.torchvision)
            if issue:
                yield issue
                continue
        if program and weights is not None and weights.seed is not None:
            yield PlanIssue(f"{loc}.weights.seed", f"model {b.model!r} is an exported program with its own weights; leave "
                                                   "weights out, or give weights.file to replace them")
            continue
        if weights is not None and weights.file is not None:
            issue = _file_issue(plan, f"{loc}.weights.file", weights.file, "weights")
            if issue:
                yield issue
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

    for name in good_blocks:
        block = plan.blocks[name]
        if (block.precision in ("fp16", "bf16") and plan.block_outputs(block)
                and detection.is_detection(plan.models[block.model].network)):  # not an exported program's outputs
            # Its heads, proposals and NMS run in the block's precision: torchvision's NMS has no bf16
            # kernel, and its batched NMS offsets boxes by class in their dtype, which fp16 cannot hold apart.
            yield PlanIssue(f"blocks.{name}.precision", f"{block.precision} for a detector's last stages (heads, NMS); give "
                                                        "this block fp32 or tf32 (its backbone's blocks may run fp16)")
    for tname, task in raw.tasks.items():
        path_issues = list(_path_issues(plan, tname, task, good_blocks))
        yield from path_issues
        if not path_issues and task.path and set(task.path) <= good_blocks:
            yield from _side_input_issues(plan, tname)
    yield from crossing.issues(plan)
    modes = sorted({t.hand_over for t in plan.tasks.values()} - {"ensemble"})
    if len(modes) > 1:
        yield PlanIssue("hand_over", f"tasks hand over {' and '.join(map(repr, modes))}: a plan's blocks hand over one way "
                                     "beyond the ensemble; give its tasks one of them (or 'ensemble')")
    if "chain" in modes and plan.raw.servers:
        yield PlanIssue("hand_over", "a chain's links hand over within one server; a plan that spans servers hands over "
                                     "'ensemble' or 'direct'")
    for name in good_blocks:
        feeders = plan.block_feeders(plan.blocks[name])
        if len(set(feeders.values())) > 1:
            # One Triton model has one input dtype, and a hop crosses in the precision of the block before it.
            listed = ", ".join(f"{b!r} ({d})" for b, d in sorted(feeders.items()))
            yield PlanIssue(f"blocks.{name}", f"the blocks before it on different paths hand on different dtypes: {listed}; "
                                              "give them precisions that hand on one dtype (fp16, bf16, or fp32/tf32)")


def _stage_file_issues(plan: Plan, name: str, written: ModelDef) -> Iterable[PlanIssue]:
    """Why a model cut into stage files cannot be served: a file, or two files that do not fit."""
    files = written.stage_files or []
    issues = [i for i in (_file_issue(plan, f"models.{name}.stage_files[{k}]", f, "stage files") for k, f in enumerate(files)) if i]
    if issues:
        yield from issues
        return
    given = written.input_shape if "input_shape" in written.model_fields_set else None
    try:
        shapes = stage_files.stage_file_shapes([str(plan.file_path(f)) for f in files], given)
    except ValueError as exc:
        yield PlanIssue(f"models.{name}.stage_files", str(exc))
        return
    if len(shapes[0][0]) != 1:
        yield PlanIssue(f"models.{name}.stage_files[0]", f"the first stage takes {len(shapes[0][0])} tensors; it must take "
                                                          "one, the task's input")
    elif given is not None and shapes[0][0][0] != tuple(given):
        yield PlanIssue(f"models.{name}.input_shape", f"{list(given)} but {files[0]} takes {list(shapes[0][0][0])}; "
                                                      "leave input_shape out, or give the file's")
    if len(shapes[-1][1]) != 1:
        yield PlanIssue(f"models.{name}.stage_files[{len(files) - 1}]", f"the last stage gives {len(shapes[-1][1])} tensors; "
                                                                         "it must give one, the task's output")
    for k in range(1, len(files)):
        if shapes[k][0] != shapes[k - 1][1]:
            yield PlanIssue(f"models.{name}.stage_files[{k}]",
                            f"{files[k]} takes {_shapes([list(t) for t in shapes[k][0]])} but {files[k - 1]} gives "
                            f"{_shapes([list(t) for t in shapes[k - 1][1]])}; list files whose tensors match, in order")


def torchvision_weights_issue(loc: str, model: ModelDef, name: str) -> PlanIssue | None:
    """Why torchvision's weights ``name`` cannot serve ``model``, or None."""
    if model.arch is None:
        return PlanIssue(loc, "torchvision's trained weights are for torchvision models (arch); an exported program or "
                              "stage files carry their own: give weights.file to replace them")
    try:
        trained = trained_weights(model.arch, name)
    except ValueError as exc:
        return PlanIssue(loc, str(exc))
    if trained.num_classes and trained.num_classes != model.num_classes:
        return PlanIssue(loc, f"{model.arch} weights {trained.name} have {trained.num_classes} classes, the model "
                              f"{model.num_classes} (num_classes): use the same, or give weights.file")
    return None


def _file_issue(plan: Plan, loc: str, written: str, what: str) -> PlanIssue | None:
    """Why the file a plan names at ``loc`` cannot be read (None: it can)."""
    # Resolved (links followed) before the check, so '..' or a link cannot leave the allowed directories.
    file = plan.file_path(written)
    if not plan.allows(file):
        return PlanIssue(loc, f"{written!r} is outside the directories this server reads {what} from "
                              f"({', '.join(map(str, plan.weights_dirs or []))}); put the file there, or start "
                              "`blockflow serve` with --weights-dir naming its directory")
    if not file.is_file():
        return PlanIssue(loc, f"file not found: {plan.base_dir / written} (paths are relative to the plan file)")
    return None


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
                                 f"a path covers its model's stages in order from 0 to the last, each once (going on from one "
                                 "model's block to another's, at the next stage of that model)")
            return
        if prev is not None:
            pb = plan.blocks[prev_name]
            out = [list(t) for t in plan.block_out_shapes(pb)]
            inp = [list(t) for t in plan.block_in_shapes(block)]
            if out != inp and pb.model != block.model:
                yield PlanIssue(loc, f"block {bname!r} (model {block.model!r}) takes {_shapes(inp)} but {prev_name!r} "
                                     f"(model {pb.model!r}) gives {_shapes(out)}; a path goes on from one model's block to "
                                     "another's only at a cut where the tensors match")
                return
            if out != inp:
                yield PlanIssue(loc, f"block {bname!r} takes {_shapes(inp)} but {prev_name!r} gives {_shapes(out)}; "
                                     "use blocks of models whose shapes match at this cut")
                return
        prev, prev_name = raw.blocks[bname], bname
    if prev is not None:
        last_block = plan.blocks[prev_name]
        n = raw.models[last_block.model].stage_count
        if last_block.last != n - 1:
            yield PlanIssue(f"tasks.{tname}.path", f"path ends at stage {last_block.last} but model {last_block.model!r} "
                                                   f"has stages 0..{n - 1}; add blocks up to stage {n - 1}")
        shapes = {tuple(plan.models[plan.blocks[b].model].input_shape) for b in task.path}
        if len(shapes) > 1:
            # Each hop's shapes matched; the unsplit reference and the task's clients also need one
            # image size along the path (a path may go on from one model's blocks to another's).
            models = dict.fromkeys(plan.blocks[b].model for b in task.path)
            listed = ", ".join(f"{m!r} takes {list(plan.models[m].input_shape)}" for m in models)
            yield PlanIssue(f"tasks.{tname}.path", f"the models of one path must take the same input_shape, but {listed}; "
                                                   "give them one input_shape")


# The ensemble's own tensors between its steps (``blockflow.ensemble_gen.configs.ensemble_config``).
_HOP_TENSOR = re.compile(r"^hop[0-9]+_")


def _side_input_issues(plan: Plan, tname: str) -> Iterable[PlanIssue]:
    """Why ``tname``'s inputs besides the image (its path's side inputs) cannot be served as written."""
    task = plan.tasks[tname]
    blocks = [plan.blocks[b] for b in task.path]
    seen: dict[str, tuple[str, SideInput]] = {}  # name -> (the first model that reads it, what it is there)
    for model in dict.fromkeys(b.model for b in blocks):
        read = {n for b in blocks if b.model == model for n in plan.block_side_inputs(b)}
        for side in plan.model_side_inputs(model):
            if side.name not in read:
                continue
            first = seen.setdefault(side.name, (model, side))
            if first[1] != side:
                yield PlanIssue(f"tasks.{tname}.path", f"side input {side.name!r} is {_side(first[1])} in model {first[0]!r} "
                                                       f"but {_side(side)} in model {model!r}; one task input has one dtype "
                                                       "and shape: export the programs with the same, or rename one")
    sides = plan.task_side_inputs(task)
    if not sides:
        return
    last = blocks[-1]
    answers = {o.name for o in plan.block_outputs(last)} or {LOGITS}
    for side in sides:
        if side.name in answers:
            yield PlanIssue(f"tasks.{tname}.path", f"side input {side.name!r} is also the name of one of the task's outputs "
                                                   f"({', '.join(sorted(answers))}); rename the program's argument or output")
        elif _HOP_TENSOR.match(side.name):
            yield PlanIssue(f"tasks.{tname}.path", f"side input {side.name!r} looks like a tensor the task's ensemble names "
                                                   "between its steps (hop<i>_...); rename the program's argument")
    yield from crossing.side_input_issues(plan, task, sides)


def _side(side: SideInput) -> str:
    return f"{side.dtype} {list(side.shape)}"


def _shapes(shapes: list[list[int]]) -> str:
    """One tensor's shape as ``[a, b]``; several as ``[a, b] + [c, d]``."""
    return " + ".join(str(t) for t in shapes)
