"""The one naming rule for generated Triton models.

* A task's ensemble on its own transport is named after the task: ``cls_a``.
* A block model on the plan's transport is named after the block: ``r50_s0``.
* Any other transport variant appends ``__`` and the transport with ``-`` made
  ``_``: ensemble ``cls_a__triton_cpu`` runs blocks ``r50_s0__triton_cpu`` ….
* Blocks fused into one model (``fuse: auto``) are named ``<first>__to__<last>``.
* Task heads packed into one model (``pack: heads``) after segment ``<seg>``
  are ``<seg>__heads`` (``<seg>__heads2``, … when several packs follow it).
* Whole models packed into one model (``pack: all``) are ``<seg>__pack``, after the deployed
  segment of the pack's first member (no other task runs it, so the name is the pack's alone;
  a live change that gives that segment a stand-in renames the pack with it).
* The monolithic references of a task (same weights, unsplit, in the task's precision) are
  ``<task>__ref`` (eager) and ``<task>__ref_graph`` (CUDA graphs); a task in another precision
  than fp32 also gets ``<task>__ref_fp32`` (eager, fp32) to check its accuracy against.

Plan names may not contain ``__``, so generated names never collide with them.
"""

from __future__ import annotations

from blockflow.core.spec import TransportName

SEP = "__"


def transport_suffix(transport: TransportName) -> str:
    return SEP + transport.replace("-", "_")


def block_model(block: str, transport: TransportName, default: TransportName) -> str:
    return block if transport == default else block + transport_suffix(transport)


def task_model(task: str, transport: TransportName, own: TransportName) -> str:
    return task if transport == own else task + transport_suffix(transport)


def reference_model(task: str, graph: bool) -> str:
    return f"{task}{SEP}ref_graph" if graph else f"{task}{SEP}ref"


def fp32_reference(task: str) -> str:
    return f"{task}{SEP}ref_fp32"


def segment_model(blocks: list[str] | tuple[str, ...]) -> str:
    """The model running ``blocks`` (consecutive, fused): the block's own name when there is one."""
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]}{SEP}to{SEP}{blocks[-1]}"


def head_pack(after: str, index: int = 1) -> str:
    """The model running the packed heads that follow segment ``after`` (``index`` > 1 for further packs)."""
    return f"{after}{SEP}heads" + (str(index) if index > 1 else "")


def model_pack(first: str) -> str:
    """The model running the packed whole models whose first member's segment is ``first``."""
    return f"{first}{SEP}pack"


def run_ensemble(task: str, index: int) -> str:
    """The ensemble of run ``index`` > 0 of a task whose path crosses servers (``blockflow.plan.crossing``)."""
    return f"{task}{SEP}run{index}"


def crossing_model(task: str, index: int) -> str:
    """The model that sends a task's request on to run ``index`` on the next server."""
    return f"{task}{SEP}cross{index}"
