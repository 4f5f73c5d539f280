"""GPU memory of a plan, predicted: BlockFlow's deployment vs one full model per task.

Every block instance is a process, and on a GPU each process costs

    overhead (CUDA context, torch, cuBLAS/cuDNN handles, kernels loaded on first use: calibrated,
              ``process_mib`` with CUDA graphs, ``eager_process_mib`` without)
  + weights (parameters and buffers of its stages, at its precision)
  + CUDA-graph pools, with ``cuda_graphs`` (``activation_factor`` x max batch x the largest tensor
              its stages make per sample; in a pack, of heads or of whole models, that for its largest
              member, plus ``pack_head_factor`` x max batch x the largest tensor of each other member:
              what each further member's graphs keep beside the pool they share. Without graphs, warm-up ends
              with ``torch.cuda.empty_cache()`` and what remains is in the overhead)
  + its TensorMQ pool (``tensormq.pool_mb``, when it hands activations on over TensorMQ).

The server process adds ``server_mib`` plus Triton's CUDA pool per GPU, for either deployment.
The *traditional* deployment of the same tasks runs each task's whole path in one process
(one full model per task, the same settings, no TensorMQ pool). Calibration
(``python -m blockflow.bench.memory``) fits the constants to NVML measurements of real plans.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from blockflow.core import detection
from blockflow.core.arch import meta_network, slice_stages
from blockflow.core.errors import CalibrationError
from blockflow.core.programs import SIDE_DTYPES
from blockflow.core.side_inputs import side_inputs, stage_side_inputs
from blockflow.plan import naming
from blockflow.plan.deployment import Block, Plan
from blockflow.plan.load import parse_plan
from blockflow.plan.schema import PlanModel

MODEL_VERSION = 3
# The plan's default pack_size (blockflow.plan.schema.PlanModel), which the scenarios' packed variant uses.
PACK_SIZE = int(PlanModel.model_fields["pack_size"].default)

BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Calibration:
    process_mib: float = 885.0  # per process with CUDA graphs: CUDA context, torch, library handles, loaded kernels
    activation_factor: float = 8.4  # CUDA-graph pools per byte of the largest tensor at max batch
    eager_process_mib: float = 544.0  # per process without CUDA graphs
    server_mib: float = 913.0  # tritonserver's own CUDA context (its CUDA pool is added separately)
    pack_head_factor: float = 4.3  # graph memory of each head of a pack after its largest, per byte as above
    source: str = "built-in estimate (not calibrated)"
    # Which formula the constants belong to: model 1 had one overhead for every process; model 2
    # charged every head of a pack a full graph pool.
    model: int = MODEL_VERSION

    @classmethod
    def load(cls, path: Path) -> Calibration:
        data = json.loads(path.read_text())
        if data.get("model", 1) != MODEL_VERSION:
            raise CalibrationError(f"calibration {path} was fitted for memory model {data.get('model', 1)}, this is model "
                                 f"{MODEL_VERSION}; refit it: python -m blockflow.bench.memory --refit-from <results> --out DIR")
        keys = ("process_mib", "activation_factor", "eager_process_mib", "server_mib", "pack_head_factor", "source")
        return cls(**{k: data[k] for k in keys if k in data})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


# The calibrations BlockFlow ships (blockflow/data/calibration), by the GPU they were fitted on; the
# first is the default for a GPU of another kind, or none (planning on a machine without one).
SHIPPED = ("h100", "h200")


def shipped_calibration(gpu: str | None = None) -> Path:
    """The calibration file BlockFlow ships for ``gpu`` (a GPU's name as NVML gives it, "NVIDIA H200",
    or a key of ``SHIPPED``), inside the package in a checkout and in a wheel alike; the H100's
    for any other GPU or none."""
    words = re.findall(r"[a-z0-9]+", gpu.lower()) if gpu is not None else []
    key = next((k for k in SHIPPED if k in words), SHIPPED[0])  # "NVIDIA H200" is an H200; "NVIDIA GH200" is not
    return Path(str(resources.files("blockflow") / "data" / "calibration" / f"{key}.json"))


@dataclass(frozen=True)
class Process:
    """One process (a model instance) on one GPU, with its predicted memory."""
    model: str
    gpu: int
    weights_mib: float
    activations_mib: float
    pool_mib: float
    overhead_mib: float
    cuda_graphs: bool = True

    @property
    def total_mib(self) -> float:
        return self.weights_mib + self.activations_mib + self.pool_mib + self.overhead_mib


@lru_cache(maxsize=64)
def _stage_profile(arch: str, cut_points: tuple[str, ...], input_shape: tuple[int, ...], num_classes: int,
                   first: int, last: int) -> tuple[int, int]:
    """(parameter + buffer count, largest tensor's element count per sample) of stages first..last (meta device)."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

    net = meta_network(arch, num_classes, input_shape)
    xs: tuple[torch.Tensor, ...] = (torch.empty((1, *input_shape), device="meta"),)
    # Task inputs besides the image (an exported program's): each stage range takes those it reads after its hop tensors.
    sides = {s.name: torch.empty((1, *s.shape), device="meta", dtype=SIDE_DTYPES[s.dtype])
             for s in side_inputs(arch, input_shape, num_classes)}

    def read(a: int, b: int) -> tuple[torch.Tensor, ...]:
        return tuple(sides[n] for n in stage_side_inputs(arch, cut_points, input_shape, num_classes, a, b)) if sides else ()

    if first > 0:
        entering = slice_stages(net, arch, cut_points, 0, first - 1)(*xs, *read(0, first - 1))
        xs = entering if isinstance(entering, tuple) else (entering,)
    part = slice_stages(net, arch, cut_points, first, last)
    ShapeProp(part).propagate(*xs, *read(first, last))  # every node's output shape, on the meta device
    largest = max([x.numel() for x in xs] + [int(torch.Size(n.meta["tensor_meta"].shape).numel()) for n in part.graph.nodes
                                             if isinstance(n.meta.get("tensor_meta"), TensorMetadata)])
    params = sum(p.numel() for p in part.parameters()) + sum(b.numel() for b in part.buffers())
    return params, largest


@lru_cache(maxsize=64)
def _file_stage_profile(files: tuple[str, ...], input_shape: tuple[int, ...], first: int, last: int) -> tuple[int, int]:
    """:func:`_stage_profile` of pre-cut stage files: their parameters and buffers, and the largest
    tensor that crosses their edges (what happens inside a file is not looked into)."""
    from blockflow.core.stage_files import load_stage_file, stage_file_shapes

    shapes = stage_file_shapes(files, input_shape)[first:last + 1]
    params = 0
    for f in files[first:last + 1]:
        module = load_stage_file(f)
        params += sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
    largest = max(math.prod(s) for ins, outs in shapes for s in (*ins, *outs))
    return params, largest


def _gpus_of(block: Block, gpus: int) -> list[int]:
    if block.placement == "cpu" or (block.placement == "auto" and gpus == 0):
        return []
    if isinstance(block.placement, tuple):
        return list(block.placement)
    return list(range(gpus))


def _process(plan: Plan, name: str, chains: list[list[Block]], deploy: Block, gpu: int, pool_mib: float, cal: Calibration) -> Process:
    """One process running ``chains`` (one chain of consecutive blocks, or a pack's members: heads,
    or whole models).

    A pack pays weights per member, the overhead once, and a graph pool sized by its largest member
    plus a smaller share for each other member.
    """
    def profile(model: str, first: int, last: int) -> tuple[int, int]:
        m = plan.models[model]
        if m.stage_files is not None:
            return _file_stage_profile(tuple(m.stage_files), tuple(m.input_shape), first, last)
        return _stage_profile(m.network, tuple(m.cut_points), tuple(m.input_shape), m.num_classes, first, last)

    weight_bytes = 0
    largests: list[int] = []
    for blocks in chains:
        # A whole path (one model per task) may go on from one model's blocks to another's, in other
        # precisions: each run of one model and precision weighed as itself.
        largest = 0
        for (model, precision), run in itertools.groupby(blocks, key=lambda b: (b.model, b.precision)):
            run_blocks = list(run)
            p, a = profile(model, run_blocks[0].first, run_blocks[-1].last)
            weight_bytes += p * BYTES[precision]
            largest = max(largest, a * BYTES[precision])  # bytes: the graph's tensors in their run's precision
        largests.append(largest)
    # A network of several outputs runs eagerly, but for a detector's traced stages (blockflow.backend.runtime).
    graphed = deploy.cuda_graphs and all(not plan.block_outputs(c[-1]) or detection.is_detection(plan.models[c[-1].model].network)
                                         for c in chains)
    if graphed:
        per_sample = cal.activation_factor * max(largests) + cal.pack_head_factor * (sum(largests) - max(largests))
        graphs, overhead = deploy.max_batch_size * per_sample / 2**20, cal.process_mib
    else:
        graphs, overhead = 0.0, cal.eager_process_mib
    return Process(name, gpu, weight_bytes / 2**20, graphs, pool_mib, overhead, graphed)


def modular(plan: Plan, gpus: int, cal: Calibration) -> list[Process]:
    """The processes `blockflow serve` starts for ``plan`` (every transport variant; references excluded)."""
    out: list[Process] = []
    seen: set[str] = set()
    for task in plan.tasks.values():
        deployed = plan.deployed(task)
        for transport in plan.transports_of(task):
            for i, unit in enumerate(deployed):
                name = naming.block_model(unit.name, transport, plan.transport)
                if name in seen:
                    continue
                seen.add(name)
                chains = [list(h) for h in unit.pack.heads] if unit.pack else [list(unit.blocks)]
                deploy = unit.blocks[0]
                producer = transport == "tensormq" and i < len(deployed) - 1
                pool = float(plan.raw.tensormq.pool_mb) if producer else 0.0
                for gpu in _gpus_of(deploy, gpus):
                    out += [_process(plan, name, chains, deploy, gpu, pool, cal)] * deploy.instances
    return out


def traditional(plan: Plan, gpus: int, cal: Calibration) -> list[Process]:
    """One full model per task: its whole path in one process, deployed like its first block."""
    out: list[Process] = []
    for task in plan.tasks.values():
        blocks = [plan.blocks[b] for b in task.path]
        for gpu in _gpus_of(blocks[0], gpus):
            out += [_process(plan, task.name, [blocks], blocks[0], gpu, 0.0, cal)] * blocks[0].instances
    return out


def per_gpu(processes: list[Process], gpus: int, cal: Calibration, cuda_pool_mb: int = 2048) -> dict[int, float]:
    """Predicted MiB on each GPU: the processes on it, plus the server's context and CUDA pool."""
    total = dict.fromkeys(range(gpus), cal.server_mib + cuda_pool_mb)
    for p in processes:
        total[p.gpu] = total.get(p.gpu, cal.server_mib + cuda_pool_mb) + p.total_mib
    return total


# --------------------------------------------------------------------------- the thesis' scenarios

SCENARIOS: dict[int, tuple[float, float, float]] = {  # thesis Table 4.4: share of tasks in class A, B, C
    1: (1 / 3, 1 / 3, 1 / 3), 2: (0.10, 0.30, 0.60), 3: (0.05, 0.20, 0.75), 4: (0.05, 0.05, 0.90),
    5: (0.01, 0.04, 0.95), 6: (0.60, 0.30, 0.10), 7: (0.75, 0.20, 0.05), 8: (0.90, 0.05, 0.05),
}


def scenario_plan(arch: str, n_tasks: int, shares: tuple[float, float, float], fuse: bool = True, pack: bool = False,
                  pack_size: int = PACK_SIZE) -> Plan:
    """:func:`scenario_raw` parsed."""
    return parse_plan(scenario_raw(arch, n_tasks, shares, fuse, pack, pack_size), source=f"{arch} scenario {shares}")


def scenario_raw(arch: str, n_tasks: int, shares: tuple[float, float, float], fuse: bool = True, pack: bool = False,
                 pack_size: int = PACK_SIZE) -> dict[str, Any]:
    """The thesis' service classes (§4.3) as a plan: class A tasks run a whole network of their own;
    class B share stages 0-1 and own stages 2-3; class C share stages 0-2 and own stage 3.

    With ``pack`` (``pack: all``), the heads of class B (after the shared stages 0-1), the heads of
    class C (after stage 2) and class A's whole networks run in packs of at most ``pack_size``
    members each (class A's several to a process, where the traditional deployment runs one model
    per task). ``shares`` (1, 0, 0) without ``pack`` is the traditional deployment itself."""
    n_a = round(n_tasks * shares[0])
    n_b = round(n_tasks * shares[1])
    n_c = n_tasks - n_a - n_b
    blocks: dict[str, object] = {"s0": {"model": "m", "stages": 0}, "s1": {"model": "m", "stages": 1},
                                 "s2": {"model": "m", "stages": 2}}
    tasks: dict[str, object] = {}
    for i in range(n_a):
        blocks[f"a{i}"] = {"model": "m", "stages": [0, 3], "weights": {"seed": 1000 + i}}
        tasks[f"task_a{i}"] = {"path": [f"a{i}"]}
    for i in range(n_b):
        blocks[f"b{i}_2"] = {"model": "m", "stages": 2, "weights": {"seed": 2000 + i}}
        blocks[f"b{i}_3"] = {"model": "m", "stages": 3, "weights": {"seed": 2000 + i}}
        tasks[f"task_b{i}"] = {"path": ["s0", "s1", f"b{i}_2", f"b{i}_3"]}
    for i in range(n_c):
        blocks[f"c{i}_3"] = {"model": "m", "stages": 3, "weights": {"seed": 3000 + i}}
        tasks[f"task_c{i}"] = {"path": ["s0", "s1", "s2", f"c{i}_3"]}
    if n_c == 0:
        del blocks["s2"]
    if n_b + n_c == 0:
        del blocks["s0"], blocks["s1"]
    raw = {"version": 1, "name": f"{arch}-scenario", "fuse": "auto" if fuse else "none", "pack": "all" if pack else "none",
           **({"pack_size": pack_size} if pack else {}),
           "models": {"m": {"arch": arch, "cut_points": ["layer1", "layer2", "layer3"]}},
           "defaults": {"placement": [0]}, "blocks": blocks, "tasks": tasks, "transport": "tensormq",
           # Pools sized to need: 64 MiB holds several batches of 8 of any of these activations.
           "tensormq": {"pool_mb": 64}}
    return raw


def scenario_table(arch: str, n_tasks: int, cal: Calibration, cuda_pool_mb: int = 2048) -> list[dict[str, float]]:
    """Predicted GPU memory (one GPU) for the eight scenarios: modular, fused, fused and packed (heads
    and class A's whole models, ``pack: all``, packs of the default ``pack_size``), traditional."""
    rows = []
    for number, shares in SCENARIOS.items():
        variants = {"modular": scenario_plan(arch, n_tasks, shares, fuse=False),
                    "fused": scenario_plan(arch, n_tasks, shares, fuse=True),
                    "packed": scenario_plan(arch, n_tasks, shares, fuse=True, pack=True)}
        procs = {k: modular(p, 1, cal) for k, p in variants.items()}
        procs["traditional"] = traditional(variants["modular"], 1, cal)
        mib = {k: per_gpu(v, 1, cal, cuda_pool_mb)[0] for k, v in procs.items()}
        row: dict[str, float] = {"scenario": number, "class_a": shares[0], "class_b": shares[1], "class_c": shares[2]}
        for k in procs:
            row[f"{k}_mib"] = mib[k]
            row[f"processes_{k}"] = float(len(procs[k]))
            if k != "traditional":
                row[f"saving_{k}"] = 1 - mib[k] / mib["traditional"]
        rows.append(row)
    return rows
