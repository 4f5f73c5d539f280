"""What a benchmark serves of a plan: the models of a task it measures, and the plans it derives from the
one it is given (in one precision, the split and its unsplit graph only, spread over several GPUs)."""

from __future__ import annotations

import math
from typing import Any

from blockflow.plan import Plan, naming, parse_plan

# The most detections per image a torchvision detector gives by default (RetinaNet's and SSD's 300).
MAX_DETECTIONS = 300


def answer_bytes(plan: Plan, task_name: str, batch: int) -> int:
    """The most bytes a request of ``batch`` images gets back from the task (what an output's
    shared-memory region must hold): its LOGITS, or each of a detector's outputs at its most detections."""
    last = plan.blocks[plan.tasks[task_name].path[-1]]
    outputs = plan.block_outputs(last)
    if not outputs:
        return 4 * math.prod(plan.block_out_shape(last)) * batch
    return batch * sum((8 if o.dtype == "int64" else 4) * math.prod(MAX_DETECTIONS if d == -1 else d for d in o.shape)
                       for o in outputs)


def task_models(plan: Plan, task_name: str) -> dict[str, dict[str, Any]]:
    """label -> {model, blocks}: the task's monolithic references first, then each transport's ensemble."""
    task = plan.tasks[task_name]
    out: dict[str, dict[str, Any]] = {}
    for v in plan.raw.references:
        out[f"monolithic-{v}"] = {"model": naming.reference_model(task.name, v == "graph"), "blocks": []}
    for tr in plan.transports_of(task):
        out[str(tr)] = {"model": naming.task_model(task.name, tr, task.transport),
                        "blocks": [naming.block_model(u.name, tr, plan.transport) for u in plan.deployed(task)]}
    return out


def in_precision(plan: Plan, precision: str) -> Plan:
    """``plan`` with every block in ``precision``; a detector's last block stays fp32 where that is
    fp16 or bf16, which its NMS cannot take (``blockflow.core.detection``)."""
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    raw.setdefault("defaults", {})["precision"] = precision
    for name, b in raw["blocks"].items():
        b.pop("precision", None)
        if precision in ("fp16", "bf16") and plan.block_outputs(plan.blocks[name]):
            b["precision"] = "fp32"
    raw["name"] = f"{plan.raw.name}-{precision}"
    return parse_plan(raw, source=f"{plan.source} in {precision}", base_dir=plan.base_dir)


def split_and_graph(plan: Plan, precision: str | None) -> Plan:
    """``plan`` serving only its first task's split and its unsplit CUDA graph (in ``precision``)."""
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    raw["compare"], raw["references"] = [], ["graph"]
    reduced = parse_plan(raw, source=f"{plan.source} (split and unsplit graph)", base_dir=plan.base_dir)
    return in_precision(reduced, precision) if precision else reduced


def spread(plan: Plan, task: str, k: int) -> Plan:
    """``plan`` with ``task``'s blocks placed round-robin on GPUs 0..k-1 (only that task, tensormq + triton-gpu)."""
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    path = plan.tasks[task].path
    raw["blocks"] = {b: dict(raw["blocks"][b], placement=[i % k]) for i, b in enumerate(path)}
    raw["tasks"] = {task: raw["tasks"][task]}
    raw["compare"] = [t for t in ("triton-gpu",) if t != raw.get("transport")]
    raw["references"] = []
    raw["name"] = f"{plan.raw.name}-on-{k}-gpus"
    return parse_plan(raw, source=f"{plan.source} spread over {k} GPU(s)", base_dir=plan.base_dir)
