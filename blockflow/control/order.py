"""How a live plan change is ordered where blocks' wiring changes: direct hand-overs that move,
blocks that get other feeders, and blocks that change what they compute under their own names
(:mod:`blockflow.control.apply`, module docstring steps 0 and 3–4).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from blockflow.control.diff import Change, Served
from blockflow.core.also_accepts import AlsoAccepts
from blockflow.core.spec import ModelSpec
from blockflow.ensemble_gen.configs import DIGEST_PARAMETER, handed_pairs, without_hand_overs
from blockflow.ensemble_gen.rendered import RenderedModel, RenderedRepository
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


def hand_over_order(ensembles: Iterable[Change], old: Mapping[str, RenderedModel | None],
                    new: Mapping[str, RenderedModel], served: Iterable[Served]) -> HandOverOrder:
    """Which changed ``ensembles`` load before the blocks, given their ``old`` (repository) and ``new`` models."""
    ready = {s.name for s in served}
    first, bridged = [], []
    for c in ensembles:
        before = old.get(c.model)
        if c.action != "change" or before is None:
            continue
        now = new[c.model]
        had, has = handed_pairs(before.config), handed_pairs(now.config)
        if had <= has:
            continue  # no block stops handing over: blocks first
        if has < had and set(now.steps) <= ready:
            first.append(c)
        else:
            bridged.append(c)
    return HandOverOrder(tuple(first), tuple(bridged))


def hand_overs_changed(ensembles: Iterable[Change], old: Mapping[str, RenderedModel | None],
                       new: Mapping[str, RenderedModel]) -> frozenset[str]:
    """The changed ``ensembles`` whose direct hand-overs differ between their ``old`` and ``new`` models:
    an undo runs them as a plain chain while their blocks go back (:meth:`~blockflow.control.undo.Undo._undo`).
    An old ensemble whose files did not parse is not one: its hand-overs are unknown."""
    return frozenset(c.model for c in ensembles
                     if c.action == "change" and (before := old.get(c.model)) is not None and not before.unreadable
                     and (now := new.get(c.model)) is not None and handed_pairs(before.config) != handed_pairs(now.config))


def chain_parts_changed(blocks: Iterable[Change], old: Mapping[str, RenderedModel | None],
                        new: Mapping[str, RenderedModel]) -> tuple[str, ...]:
    """The changed ``blocks`` whose part in a chain (plan option ``hand_over: chain``) changes: a link
    takes no requests and a chain's head hands over what the ensemble never asks for, so neither can
    switch while old ensembles run (:meth:`~blockflow.control.apply.Applier._change` refuses them)."""
    def part(model: RenderedModel | None) -> tuple[object, ...]:
        role = model.spec.hand_over if model is not None and model.spec is not None else None
        if role is None or not (role.link or role.own_keys or role.to_link):
            return ()
        return role.link, role.own_keys, role.to_link, role.to, role.takes_from, role.keys_from

    return tuple(sorted(c.model for c in blocks if c.action == "change" and c.model in new
                        and part(old.get(c.model)) != part(new[c.model])))


def bridge(ensemble: RenderedModel) -> RenderedModel:
    """An ensemble with its steps as a plain chain, stamped so that no plan's digest matches it: a
    server left running it (an apply cut short) is brought in step by the next apply."""
    cfg = without_hand_overs(ensemble.config)
    cfg.parameters[DIGEST_PARAMETER].string_value = f"bridge-{ensemble.digest}"
    return ensemble.with_config(cfg)


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


def _lease_s(spec: ModelSpec | None) -> float:
    return spec.tensormq.lease_s if spec is not None and spec.tensormq is not None else 0.0


def _others(was: ModelSpec | None, now: ModelSpec | None) -> AlsoAccepts:
    """What ``was`` took that ``now`` does not: feeders and hand-over keys, where both take some."""
    def taken(spec: ModelSpec | None) -> tuple[set[str], set[str]]:
        if spec is None:
            return set(), set()
        return set(spec.accepts_from), set(spec.hand_over.keys_from if spec.hand_over is not None else ())

    (had, had_keys), (has, has_keys) = taken(was), taken(now)
    return AlsoAccepts(models=tuple(sorted(had - has)) if has else (),
                       keys=tuple(sorted(had_keys - has_keys)) if has_keys else ())


def widening(blocks: Iterable[Change], old: Mapping[str, RenderedModel | None],
             new: Mapping[str, RenderedModel]) -> Widening:
    """Which changed ``blocks`` get other feeders, given their ``old`` (repository) and ``new`` models."""
    to_new: dict[str, AlsoAccepts] = {}
    to_old: dict[str, AlsoAccepts] = {}
    lease: dict[str, float] = {}
    for c in blocks:
        before = old.get(c.model)
        if c.action != "change" or before is None:
            continue
        was, now = before.spec, new[c.model].spec
        for side, extra in ((to_new, _others(was, now)), (to_old, _others(now, was))):
            if extra != AlsoAccepts():
                side[c.model] = extra
                lease[c.model] = max(_lease_s(was), _lease_s(now))
    return Widening(to_new, to_old, lease)


def _computes(model: RenderedModel) -> dict[str, Any]:
    """What a model's spec says it computes (its fields but those of ``_SERVING``); nothing for an ensemble."""
    return model.spec.model_dump(exclude=set(_SERVING)) if model.spec is not None else {}


def stand_ins(changes: Iterable[Change], ensembles: Mapping[str, RenderedModel | None],
              old: Mapping[str, RenderedModel | None], new: Mapping[str, RenderedModel]) -> tuple[str, ...]:
    """The plan's blocks that must first load under temporary names (step 0), given the served
    ``ensembles`` and the changed models' ``old`` (repository) and ``new`` versions.

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
        if not c.ensemble and c.action == "change" and before is not None and _computes(before) != _computes(new[c.model]):
            computing.add(c.model)
    models: set[str] = set()
    for name, ensemble in ensembles.items():
        if ensemble is None:
            continue
        steps = ensemble.steps
        hit = [m for m in steps if m in computing]
        now = new.get(name)
        if len(hit) > 1 or (hit and (now is None or now.steps != steps)):
            models.update(hit)
    # A head pack is named after the model before it (blockflow.plan.naming), so that one is renamed too.
    for model in new.values():
        if model.ensemble:
            steps = model.steps
            models.update(before for before, m in zip(steps, steps[1:], strict=False)
                          if m in models and (spec := new[m].spec) is not None and spec.kind == "pack")
    blocks: set[str] = set()
    for m in models:
        spec = new[m].spec
        if spec is not None:
            blocks.update(part.block for part in [*spec.parts, *(p for h in spec.heads for p in h.parts)])
    return tuple(sorted(blocks))


def with_stand_ins(plan: Plan, blocks: Iterable[str]) -> Plan:
    """``plan`` with ``blocks`` renamed to their stand-ins (``STAND_IN`` appended) in its blocks and paths."""
    rename = {b: b + STAND_IN for b in blocks}
    raw = plan.raw
    tasks = {t: d.model_copy(update={"path": [rename.get(b, b) for b in d.path]}) for t, d in raw.tasks.items()}
    renamed = raw.model_copy(update={"blocks": {rename.get(k, k): v for k, v in raw.blocks.items()}, "tasks": tasks})
    return Plan(renamed, plan.source, plan.base_dir, plan.weights_dirs).on_server(plan.server)


def with_planned_references(stand_in: RenderedRepository, planned: RenderedRepository, plan: Plan) -> RenderedRepository:
    """The stand-in plan's rendered repository (``stand_in``) with ``plan``'s own reference models
    (from ``planned``): a reference is in no ensemble, so it loads once, as planned, in the first of
    the two applies. Its parts name its blocks, so the stand-ins' names would change it twice."""
    refs = {m for t in plan.tasks.values() for m in plan.reference_models(t)}
    models = {name: m for name, m in stand_in.models.items() if name not in refs}
    models.update((name, m) for name, m in planned.models.items() if name in refs)
    return RenderedRepository(models, stand_in.marker)
