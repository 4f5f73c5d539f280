"""A plan that spans several servers (``servers``): which server runs each block, the runs of a
task's path on one server, and what such a plan may not use yet.

A task's path is cut into *runs*: its consecutive blocks on one server. Run 0 takes the task's
image; every later run takes the tensors the run before it hands on. Each server serves its runs
as ensembles (run 0 under the task's name, run ``i`` as ``<task>__run<i>``); a run that the path
continues after ends in a *crossing* (``<task>__cross<i+1>``, ``blockflow.backend.bridge``): it sends
its request's tensors to the next server's ensemble over Triton's gRPC, in the hop's dtype, and
answers with what that one answers. A crossing fails its request, never the server, when the
next server does not answer within that server's ``timeout_s``; the next request tries again.
A crossing carries the hop's tensors only: a task whose blocks read inputs besides the image (side
inputs) keeps its path on one server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from blockflow.core.errors import PlanIssue
from blockflow.core.spec import SideInput, hop_dtype

if TYPE_CHECKING:
    from blockflow.plan.deployment import Plan, Task

# What a crossing task's transport may be: its hops are tensors a crossing can send (TensorMQ's
# tickets name memory on one host).
CROSSING_TRANSPORTS = ("triton-cpu", "triton-gpu")


def server_of(plan: Plan, block: str) -> str:
    """The server that runs ``block`` ("" for a plan of one server)."""
    if not plan.raw.servers:
        return ""
    return plan.raw.blocks[block].server or next(iter(plan.raw.servers))


def runs(plan: Plan, task: Task) -> list[tuple[str, tuple[str, ...]]]:
    """``task``'s path as (server, its consecutive blocks there), in path order."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for name in task.path:
        server = server_of(plan, name)
        if out and out[-1][0] == server:
            out[-1] = (server, (*out[-1][1], name))
        else:
            out.append((server, (name,)))
    return out


def crosses(plan: Plan, task: Task) -> bool:
    return len(runs(plan, task)) > 1


def issues(plan: Plan) -> Iterable[PlanIssue]:
    """Why a plan that names servers cannot be served as written."""
    raw = plan.raw
    if not raw.servers:
        for name, b in raw.blocks.items():
            if b.server is not None:
                yield PlanIssue(f"blocks.{name}.server", "the plan names no servers; list them under servers "
                                                         "(name: {grpc: host:port}) or leave server out")
        return
    from blockflow.plan.schema import NAME_RE

    for name in raw.servers:
        if not NAME_RE.match(name) or "__" in name:
            yield PlanIssue(f"servers.{name}", "a server name must start with a letter; letters, digits, '_' and '-' only")
    for name, b in raw.blocks.items():
        if b.server is not None and b.server not in raw.servers:
            yield PlanIssue(f"blocks.{name}.server", f"no server {b.server!r}; the plan's servers: {', '.join(raw.servers)}")
    # Each of these deploys blocks of several tasks as one model or wires models by rules a
    # crossing does not follow yet: refused rather than served differently than written.
    for key, value, default in (("fuse", raw.fuse, "none"), ("pack", raw.pack, "none")):
        if value != default:
            yield PlanIssue(key, f"{key}: {value!r} is not served across servers yet; leave it out of a plan with servers")
    for key in ("compare", "references"):
        if getattr(raw, key):
            yield PlanIssue(key, f"{key} is not served across servers yet; leave it out of a plan with servers")
    if any(b.server is not None and b.server not in raw.servers for b in raw.blocks.values()):
        return
    for tname, task in plan.tasks.items():
        if not all(b in plan.blocks for b in task.path) or not crosses(plan, task):
            continue
        if task.transport not in CROSSING_TRANSPORTS:
            yield PlanIssue(f"tasks.{tname}.transport", f"the path crosses servers ({' → '.join(s for s, _ in runs(plan, task))}): "
                                                        f"give it transport {' or '.join(CROSSING_TRANSPORTS)} (TensorMQ's "
                                                        "tickets name memory on one host)")
        for _, blocks in runs(plan, task)[:-1]:
            last = plan.blocks[blocks[-1]]
            if hop_dtype(last.precision) == "bf16":
                yield PlanIssue(f"blocks.{last.name}.precision", f"bf16 activations cannot cross servers (task {tname!r}): "
                                                                 "give the block before a crossing fp16, fp32 or tf32")


def side_input_issues(plan: Plan, task: Task, sides: Sequence[SideInput]) -> Iterable[PlanIssue]:
    """Why ``task``, whose blocks read ``sides``, cannot cross servers as written."""
    if sides and crosses(plan, task):
        names = ", ".join(repr(s.name) for s in sides)
        yield PlanIssue(f"tasks.{task.name}.path", f"the path crosses servers ({' → '.join(s for s, _ in runs(plan, task))}) "
                                                   f"and its blocks read task inputs besides the image ({names}), which a "
                                                   "crossing does not carry; keep this task's blocks on one server")
