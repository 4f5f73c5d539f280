"""How a live plan change is ordered where blocks' wiring changes: direct hand-overs that move,
blocks that get other feeders, and blocks that change what they compute under their own names
(:mod:`blockflow.control.apply`, module docstring steps 0 and 3–4).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from blockflow.control.diff import Change, Served
from blockflow.core.also_accepts import AlsoAccepts
from blockflow.core.spec import SPEC_PARAMETER
from blockflow.ensemble_gen.configs import (
    DIGEST_PARAMETER,
    handed_pairs,
    parse_pbtxt,
    to_pbtxt,
    without_hand_overs,
)
from blockflow.plan import Plan, naming

# What a block's spec may change without changing what it computes: how it is served, and where its
# tickets come from (``also_accepts`` bridges that).
_SERVING = frozenset({"name", "max_batch_size", "monitor_period_s", "tensormq", "accepts_from", "hand_over", "cuda_graphs"})
# What a block passed under a temporary name is called meanwhile (plan names may not hold ``__``).
STAND_IN = naming.SEP + "next"


@dataclass(frozen=True)
class HandOverOrder:
    """Changed ensembles that load before the blocks because some of their blocks stop handing over
    directly (module docstring, step 4): ``first`` as planned; ``bridged`` as their old steps
    without hand-overs, then as planned after the blocks."""

    first: tuple[Change, ...] = ()
    bridged: tuple[Change, ...] = ()


def hand_over_order(ensembles: Iterable[Change], old: Mapping[str, Mapping[str, bytes] | None],
                    new: Mapping[str, Mapping[str, bytes]], served: Iterable[Served]) -> HandOverOrder:
    """Which changed ``ensembles`` load before the blocks, given their ``old`` (repository) and ``new`` files."""
    ready = {s.name for s in served}
    first, bridged = [], []
    for c in ensembles:
        before = old.get(c.model)
        if c.action != "change" or before is None or "config.pbtxt" not in before:
            continue
        cfg = parse_pbtxt(new[c.model]["config.pbtxt"].decode())
        had, has = handed_pairs(parse_pbtxt(before["config.pbtxt"].decode())), handed_pairs(cfg)
        if had <= has:
            continue  # no block stops handing over: blocks first
        if has < had and {s.model_name for s in cfg.ensemble_scheduling.step} <= ready:
            first.append(c)
        else:
            bridged.append(c)
    return HandOverOrder(tuple(first), tuple(bridged))


def bridge(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """An ensemble's files with its steps as a plain chain, stamped so that no plan's digest matches
    it: a server left running it (an apply cut short) is brought in step by the next apply."""
    cfg = without_hand_overs(parse_pbtxt(files["config.pbtxt"].decode()))
    digest = cfg.parameters[DIGEST_PARAMETER].string_value
    cfg.parameters[DIGEST_PARAMETER].string_value = f"bridge-{digest}"
    return {**files, "config.pbtxt": to_pbtxt(cfg).encode()}


@dataclass(frozen=True)
class Widening:
    """Changed TensorMQ blocks whose feeders change (:mod:`blockflow.core.also_accepts`): ``new`` maps
    each to the feeders its planned version also accepts while old paths run (its old ones), ``old``
    to those its previous version accepts too if an undo restores it (its new ones), both without
    their ``until`` yet; ``lease_s``: the planned and previous versions' lease, for how long after
    the change they keep accepting them."""

    new: Mapping[str, AlsoAccepts] = field(default_factory=dict)
    old: Mapping[str, AlsoAccepts] = field(default_factory=dict)
    lease_s: Mapping[str, float] = field(default_factory=dict)


def _spec(files: Mapping[str, bytes]) -> dict[str, Any]:
    cfg = parse_pbtxt(files["config.pbtxt"].decode())
    p = cfg.parameters.get(SPEC_PARAMETER)
    spec = json.loads(p.string_value) if p is not None else {}
    return spec if isinstance(spec, dict) else {}


def _lease_s(spec: Mapping[str, Any]) -> float:
    return float((spec.get("tensormq") or {}).get("lease_s") or 0.0)


def _others(was: Mapping[str, Any], now: Mapping[str, Any]) -> AlsoAccepts:
    """What ``was`` took that ``now`` does not: feeders and hand-over keys, where both take some."""
    def taken(spec: Mapping[str, Any]) -> tuple[set[str], set[str]]:
        return set(spec.get("accepts_from") or ()), set((spec.get("hand_over") or {}).get("keys_from") or ())

    (had, had_keys), (has, has_keys) = taken(was), taken(now)
    return AlsoAccepts(models=tuple(sorted(had - has)) if has else (),
                       keys=tuple(sorted(had_keys - has_keys)) if has_keys else ())


def widening(blocks: Iterable[Change], old: Mapping[str, Mapping[str, bytes] | None],
             new: Mapping[str, Mapping[str, bytes]]) -> Widening:
    """Which changed ``blocks`` get other feeders, given their ``old`` (repository) and ``new`` files."""
    to_new: dict[str, AlsoAccepts] = {}
    to_old: dict[str, AlsoAccepts] = {}
    lease: dict[str, float] = {}
    for c in blocks:
        before = old.get(c.model)
        if c.action != "change" or before is None or "config.pbtxt" not in before:
            continue
        was, now = _spec(before), _spec(new[c.model])
        for side, extra in ((to_new, _others(was, now)), (to_old, _others(now, was))):
            if extra != AlsoAccepts():
                side[c.model] = extra
                lease[c.model] = max(_lease_s(was), _lease_s(now))
    return Widening(to_new, to_old, lease)


def _steps(files: Mapping[str, bytes]) -> tuple[str, ...]:
    return tuple(s.model_name for s in parse_pbtxt(files["config.pbtxt"].decode()).ensemble_scheduling.step)


def _computes(files: Mapping[str, bytes]) -> dict[str, Any]:
    return {k: v for k, v in _spec(files).items() if k not in _SERVING}


def stand_ins(changes: Iterable[Change], ensembles: Mapping[str, Mapping[str, bytes] | None],
              old: Mapping[str, Mapping[str, bytes] | None], new: Mapping[str, Mapping[str, bytes]]) -> tuple[str, ...]:
    """The plan's blocks that must first load under temporary names (step 0), given the served
    ``ensembles``' files and the changed models' ``old`` (repository) and ``new`` files.

    Triton takes every step's model when an ensemble request starts, so a request that starts
    while a wave reloads blocks in place runs the served ensemble's steps on whichever of its
    blocks have reloaded by then. With one block that computes something else (another cut,
    precision or weights) that is still the new plan's request, if the ensemble keeps its steps.
    With two such blocks, or one in an ensemble whose steps change, it is neither plan's: the
    tickets' shapes may not match (refused) or the answer mixes both plans' weights. Loaded under
    other names, the new blocks join a request only through the new ensemble, which switches in
    one load.
    """
    computing = set()
    for c in changes:
        before = old.get(c.model)
        if not c.ensemble and c.action == "change" and before is not None and "config.pbtxt" in before \
                and _computes(before) != _computes(new[c.model]):
            computing.add(c.model)
    models: set[str] = set()
    for name, files in ensembles.items():
        if not files or "config.pbtxt" not in files:
            continue
        steps = _steps(files)
        hit = [m for m in steps if m in computing]
        now = new.get(name)
        if len(hit) > 1 or (hit and (now is None or _steps(now) != steps)):
            models.update(hit)
    # A head pack is named after the model before it (blockflow.plan.naming), so that one is renamed too.
    for files in new.values():
        if "config.pbtxt" in files and parse_pbtxt(files["config.pbtxt"].decode()).platform == "ensemble":
            steps = _steps(files)
            models.update(before for before, m in zip(steps, steps[1:], strict=False)
                          if m in models and _spec(new[m]).get("kind") == "pack")
    blocks: set[str] = set()
    for m in models:
        spec = _spec(new[m])
        for part in [*spec.get("parts", ()), *(p for h in spec.get("heads", ()) for p in h.get("parts", ()))]:
            blocks.add(str(part["block"]))
    return tuple(sorted(blocks))


def with_stand_ins(plan: Plan, blocks: Iterable[str]) -> Plan:
    """``plan`` with ``blocks`` renamed to their stand-ins (``STAND_IN`` appended) in its blocks and paths."""
    rename = {b: b + STAND_IN for b in blocks}
    raw = plan.raw
    tasks = {t: d.model_copy(update={"path": [rename.get(b, b) for b in d.path]}) for t, d in raw.tasks.items()}
    renamed = raw.model_copy(update={"blocks": {rename.get(k, k): v for k, v in raw.blocks.items()}, "tasks": tasks})
    return Plan(renamed, plan.source, plan.base_dir, plan.weights_dirs)


def with_planned_references(stand_in_files: Mapping[str, bytes], files: Mapping[str, bytes], plan: Plan) -> dict[str, bytes]:
    """The stand-in plan's rendered repository (``stand_in_files``) with ``plan``'s own reference
    models (``files``): a reference is in no ensemble, so it loads once, as planned, in the first of
    the two applies. Its parts name its blocks, so the stand-ins' names would change it twice."""
    refs = {m for t in plan.tasks.values() for m in plan.reference_models(t)}
    out = {k: v for k, v in stand_in_files.items() if k.split("/", 1)[0] not in refs}
    out.update((k, v) for k, v in files.items() if k.split("/", 1)[0] in refs)
    return out
