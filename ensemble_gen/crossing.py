"""The models of a plan that spans servers (``blockflow.plan.crossing``): the entry of a run that
takes the tensors the server before it handed on, and the crossing model that sends them on (its
config and its model.py)."""

from __future__ import annotations

from collections.abc import Sequence

from tritonclient.grpc import model_config_pb2 as mc

from blockflow.core.spec import ACTIVATION_IN, BRIDGE_PARAMETER, BridgeSpec, HopDtype, ModelSpec, TaskOutput, activation_names
from blockflow.ensemble_gen.configs import FORCE_CPU_PARAM, HOP_TYPES, OUTPUT_TYPES, Step, _tensor
from blockflow.plan import Plan

# What a crossing model's model.py imports (the rest as the blocks' MODEL_PY).
BRIDGE_IMPORT = "from blockflow.backend.bridge import TritonPythonModel"


def model_py(block_model_py: str) -> str:
    """A crossing model's model.py: a block's (``block_model_py``), with the crossing's runtime."""
    return block_model_py.replace("from blockflow.backend.model import TritonPythonModel", BRIDGE_IMPORT).replace(
        "this model's spec is the `blockflow.spec` parameter", "this crossing's is the `blockflow.bridge` parameter")


def entry(spec: ModelSpec) -> list[tuple[str, Sequence[int], int]]:
    """The ensemble inputs of a run that starts with the model of ``spec``: the tensors it takes."""
    names = activation_names(ACTIVATION_IN, len(spec.in_shapes))
    return [(n, s, HOP_TYPES[spec.in_dtype]) for n, s in zip(names, spec.in_shapes, strict=True)]


def add_crossing_step(cfg: mc.ModelConfig, model: str, outputs: Sequence[TaskOutput]) -> None:
    """Append to ensemble ``cfg`` the step of crossing ``model``: it takes what the last step hands
    on and gives the task's ``outputs``, which become the ensemble's."""
    last = cfg.ensemble_scheduling.step[-1]
    handed = [last.output_map[k] for k in sorted(last.output_map, key=_activation_index)]
    step = cfg.ensemble_scheduling.step.add()
    step.model_name = model
    step.model_version = -1
    for name, tensor in zip(activation_names(ACTIVATION_IN, len(handed)), handed, strict=True):
        step.input_map[name] = tensor
    del cfg.output[:]
    for o in outputs:
        step.output_map[o.name] = o.name
        cfg.output.append(_tensor(o.name, o.shape, mc.ModelOutput, OUTPUT_TYPES[o.dtype]))


def _activation_index(name: str) -> int:
    """ACTIVATION_OUT -> 0, ACTIVATION_OUT_2 -> 2."""
    head, _, tail = name.rpartition("_")
    return int(tail) if tail.isdigit() and head.endswith("OUT") else 0


def crossing_config(name: str, bridge: BridgeSpec, shapes: Sequence[Sequence[int]], dtype: HopDtype,
                    outputs: Sequence[TaskOutput], max_batch_size: int) -> mc.ModelConfig:
    """The crossing model: the hop's tensors in (host memory), the task's outputs out. On the CPU,
    two instances, each sending the requests of one call at a time (``blockflow.backend.bridge``);
    the dynamic batcher gives a call the requests that queued while both were busy."""
    cfg = mc.ModelConfig()
    cfg.name = name
    cfg.backend = "python"
    cfg.max_batch_size = max_batch_size
    for n, shape in zip(activation_names(ACTIVATION_IN, len(shapes)), shapes, strict=True):
        cfg.input.append(_tensor(n, shape, mc.ModelInput, HOP_TYPES[dtype]))
    cfg.output.extend(_tensor(o.name, o.shape, mc.ModelOutput, OUTPUT_TYPES[o.dtype]) for o in outputs)
    cfg.dynamic_batching.SetInParent()
    group = cfg.instance_group.add()
    group.kind = mc.ModelInstanceGroup.KIND_CPU
    group.count = 2
    cfg.parameters[FORCE_CPU_PARAM].string_value = "yes"
    cfg.parameters[BRIDGE_PARAMETER].string_value = bridge.model_dump_json()
    return cfg


def bridge_config(plan: Plan, name: str, steps: Sequence[Step], server: str, model: str,
                  outputs: Sequence[TaskOutput], onward: Sequence[str]) -> mc.ModelConfig:
    """The crossing model that sends a run's last hop on to ensemble ``model`` of ``server``, whose
    path goes on through blocks ``onward``."""
    last = steps[-1].spec
    target = plan.raw.servers[server]
    inputs = tuple((n, last.out_dtype) for n in activation_names(ACTIVATION_IN, len(last.out_shapes)))
    # Requests batched into one call stay within every onward block's batch; answers whose size varies
    # per request (a detector's) are not batched: each request's own answer is trimmed to its own count.
    ragged = any(-1 in o.shape for o in outputs)
    bridge = BridgeSpec(grpc=target.grpc, model=model, timeout_s=target.timeout_s, inputs=inputs,
                        outputs=tuple(o.name for o in outputs),
                        max_batch_size=0 if ragged else min(plan.blocks[b].max_batch_size for b in onward))
    return crossing_config(name, bridge, last.out_shapes, last.out_dtype, outputs, min(s.spec.max_batch_size for s in steps))
