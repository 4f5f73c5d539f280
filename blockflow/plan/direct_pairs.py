"""Which blocks hand their tickets to the next block directly (plan option ``hand_over: direct``).

A task's ensemble runs its blocks one step after another; each step costs a round trip through
Triton's ensemble scheduler (``docs/performance.md``). A *pair* ``a -> b`` hands over directly:
the ensemble gives ``b``, as a key, the ticket ``a`` was given, and runs ``a`` and ``b`` at once;
``a`` sends ``b`` its own tickets under that key (``blockflow.backend.tensormq.handover``).

A pair qualifies only where the blocks' part is the same in every task: ``a`` is the only block
after ``a`` and ``a`` the only block before ``b`` on every path, ``b`` is neither a task's second
block (``a`` would take the image, and there is no ticket to key on) nor its last (the ensemble
must take ``b``'s output), and neither is a head pack; nor does ``b`` read a task input besides the image
(a side input: the ensemble gives it to the blocks that read it, and ``b`` takes nothing from the
ensemble but its key). Consecutive pairs make a *run*
``s -> r1 -> r2 ...``: every receiver is keyed by the ticket ``s`` was given. The block after a
run's last receiver (the *join*) takes the outputs no other step takes, as optional inputs, so
that Triton runs every step of the run (it runs only the steps whose outputs some step takes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from blockflow.core.spec import HandOver


@dataclass(frozen=True)
class Wiring:
    """One task's ensemble under direct hand-overs: for each step, the step whose output it takes
    (``None``: the ensemble's image; else normally the step before), and the steps whose outputs a
    join takes as optional inputs."""

    takes: tuple[int | None, ...]
    after: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


def pairs(paths: Mapping[str, Sequence[str]], packs: Set[str] = frozenset(),
          kept: Sequence[Sequence[str]] = (), readers: Set[str] = frozenset(), chain: bool = False,
          tails: Set[str] = frozenset()) -> dict[str, str]:
    """Sender -> receiver of every pair that hands over directly, given each task's models in order
    (``kept``: the paths of tasks whose ensembles keep every step; their blocks hand over nothing;
    ``readers``: the models that read side inputs, which never receive; ``chain``: the receivers are
    links, :func:`chain_roles`; ``tails``: the models that may end a chain as its *tail*, a link
    that is the last block of every path it is on and answers the chain's head)."""
    after: dict[str, set[str]] = {}
    before: dict[str, set[str]] = {}
    steady = {m for path in kept for m in path} | set(packs)
    for path in [*paths.values(), *kept]:
        for a, b in zip(path, path[1:], strict=False):
            after.setdefault(a, set()).add(b)
            before.setdefault(b, set()).add(a)
    out: dict[str, str] = {}
    for a, nexts in sorted(after.items()):
        b = next(iter(nexts))
        if len(nexts) != 1 or before[b] != {a} or a in steady or b in steady or b in readers:
            continue
        places = [(p.index(b), len(p)) for p in paths.values() if b in p]
        if chain:  # a link is neither end of a path and hands on to one block, which takes from it only
            nexts_b = after.get(b, set())
            if len(nexts_b) == 1 and before[next(iter(nexts_b))] == {b} and all(1 <= i <= n - 2 for i, n in places):
                out[a] = b
            elif b in tails and not nexts_b and all(i == n - 1 for i, n in places):
                out[a] = b
        elif all(2 <= i <= n - 2 for i, n in places):
            out[a] = b
    return out


def chain_steps(path: Sequence[str], relay: Mapping[str, str]) -> list[str]:
    """``path``'s ensemble steps when the receivers of ``relay`` are links (``hand_over: chain``):
    every block but those, each step taking the step before's output."""
    links = set(relay.values())
    return [m for m in path if m not in links]


def chain_roles(paths: Mapping[str, Sequence[str]], relay: Mapping[str, str]) -> dict[str, HandOver]:
    """Each model's part in the chains of ``paths`` (models that play none are left out): a run
    ``h -> r1 -> ... -> rk -> j`` has its head ``h`` keying each hand-over by its own ticket, the links
    ``r*`` (no steps) handing on under that key, and its join ``j`` (the step after ``h``) given ``h``'s
    ticket as its key by the ensemble and ``rk``'s ticket for it by ``rk``. A run whose ``rk`` is its
    paths' last block (a tail, :func:`pairs`) has no join: ``rk`` answers ``h``, which answers the request."""
    links = set(relay.values())
    takes_from = {b: a for a, b in relay.items()}
    out: dict[str, dict[str, object]] = {}
    for path in paths.values():
        for model in path:
            if model in links or model not in relay:
                continue
            head, run = model, [model]  # a run's head: a sender that is no link
            while run[-1] in relay:
                run.append(relay[run[-1]])
            end = path.index(run[-1]) + 1
            join = path[end] if end < len(path) else ""  # none: run[-1] is the chain's tail
            out.setdefault(head, {}).update(to=relay[head], own_keys=True, to_link=True, answered_by="" if join else run[-1])
            for r in run[1:]:
                to = relay.get(r, join)
                out.setdefault(r, {}).update(to=to, takes_from=takes_from[r], keys_from=(head,), link=True,
                                             to_link=to in links, tail=not to)
            if join:
                out.setdefault(join, {}).update(takes_from=run[-1], keys_from=(head,), from_link=True)
    return {m: HandOver.model_validate(fields) for m, fields in sorted(out.items())}


def wiring(path: Sequence[str], relay: Mapping[str, str]) -> Wiring:
    """How ``path``'s ensemble steps are wired, given :func:`pairs`."""
    takes: list[int | None] = [None]
    after: dict[int, tuple[int, ...]] = {}
    run: list[int] = []  # the current run's steps: its sender, then its receivers so far
    for i in range(1, len(path)):
        if run and relay.get(path[i - 1]) == path[i]:
            takes.append(takes[run[0]])  # keyed by the ticket the run's sender was given
            run.append(i)
            continue
        takes.append(i - 1)
        if len(run) > 1:  # step i joins the run that ended at step i - 1
            after[i] = tuple(run[:-1])
        run = [i] if path[i] in relay else []
    return Wiring(tuple(takes), after)


def roles(paths: Mapping[str, Sequence[str]], relay: Mapping[str, str]) -> dict[str, HandOver]:
    """Each model's part in the hand-overs of ``paths`` (models that play none are left out)."""
    to: dict[str, str] = dict(relay)
    takes_from = {b: a for a, b in relay.items()}
    keys: dict[str, set[str]] = {}
    joins: dict[str, int] = {}
    for path in paths.values():
        w = wiring(path, relay)
        for i, model in enumerate(path):
            if model in takes_from:
                src = w.takes[i]
                assert src is not None  # a receiver is never a task's first or second block
                keys.setdefault(model, set()).add(path[src])
            if i in w.after:
                joins[model] = max(joins.get(model, 0), len(w.after[i]))
    out: dict[str, HandOver] = {}
    for model in sorted(set(to) | set(takes_from) | set(joins)):
        out[model] = HandOver(to=to.get(model, ""), takes_from=takes_from.get(model, ""),
                              keys_from=tuple(sorted(keys.get(model, ()))), after=joins.get(model, 0))
    return out
