"""``config.pbtxt`` messages built through Triton's protobuf schema (``model_config_pb2``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.core.spec import (
    ACTIVATION_IN,
    ACTIVATION_OUT,
    HANDED_AFTER,
    IMAGE,
    LOGITS,
    SPEC_PARAMETER,
    TICKET_BYTES,
    ModelSpec,
    SideInput,
    TaskOutput,
    activation_names,
)
from blockflow.plan import Block
from blockflow.plan.direct_pairs import Wiring

# Triton's Python backend copies GPU inputs to host memory unless told otherwise.
FORCE_CPU_PARAM = "FORCE_CPU_ONLY_INPUT_TENSORS"
# A hash of everything that defines a generated model (config, files, weights): `blockflow apply`
# reads it back from the running server to see which models a new plan changes.
DIGEST_PARAMETER = "blockflow.digest"


# Triton's type for each hop dtype.
HOP_TYPES = {"fp32": mc.TYPE_FP32, "fp16": mc.TYPE_FP16, "bf16": mc.TYPE_BF16}
OUTPUT_TYPES = {"fp32": mc.TYPE_FP32, "int64": mc.TYPE_INT64}
# Triton's type for each side input dtype (a task input besides the image): the same two.
SIDE_TYPES = OUTPUT_TYPES


# Triton's type of each way a task's image arrives (encoded: one JPEG or PNG file's bytes per image, a
# row of a uint8 [n, L] tensor zero-padded to the request's longest file; not BYTES: see python_model_config).
IMAGE_TYPES = {"float32": mc.TYPE_FP32, "uint8": mc.TYPE_UINT8, "encoded": mc.TYPE_UINT8}


def image_type(spec: ModelSpec) -> int:
    """Triton's type of the image a model that takes it is given (fp32 unless the plan says otherwise)."""
    return int(IMAGE_TYPES[spec.image.dtype if spec.image is not None else "float32"])


def _tensor(name: str, dims: Sequence[int], cls: type[mc.ModelInput] | type[mc.ModelOutput],
            data_type: int = mc.TYPE_FP32) -> mc.ModelInput | mc.ModelOutput:
    t = cls()
    t.name = name
    t.data_type = data_type
    t.dims.extend(int(d) for d in dims)
    return t


def _side_tensor(side: SideInput) -> mc.ModelInput:
    return _tensor(side.name, side.shape, mc.ModelInput, SIDE_TYPES[side.dtype])


def _instance_group(block: Block) -> mc.ModelInstanceGroup:
    group = mc.ModelInstanceGroup()
    group.count = block.instances
    if block.placement == "cpu":
        group.kind = mc.ModelInstanceGroup.KIND_CPU
    elif block.placement == "gpu":
        group.kind = mc.ModelInstanceGroup.KIND_GPU
    elif block.placement == "auto":
        # Triton resolves AUTO to one group per visible GPU, or to the CPU when there is none.
        group.kind = mc.ModelInstanceGroup.KIND_AUTO
    else:
        group.kind = mc.ModelInstanceGroup.KIND_GPU
        group.gpus.extend(block.placement)
    return group


def python_model_config(name: str, spec: ModelSpec, block: Block) -> mc.ModelConfig:
    """A Python-backend model that runs ``spec`` with ``block``'s deployment settings."""
    cfg = mc.ModelConfig()
    cfg.name = name
    cfg.backend = "python"
    cfg.max_batch_size = spec.max_batch_size
    tmq = spec.transport == "tensormq"
    encoded = spec.takes_image and spec.image is not None and spec.image.dtype == "encoded"
    if spec.takes_image:
        image = mc.ModelInput()
        image.CopyFrom(_tensor(IMAGE, spec.in_shape, mc.ModelInput, image_type(spec)))
        # Files of different lengths: requests of any L batch together (the stub hands each its own tensor).
        image.allow_ragged_batch = encoded
        cfg.input.append(image)
    elif tmq:  # a TensorMQ hop carries one 256-byte ticket per sample
        cfg.input.append(_tensor(ACTIVATION_IN, [TICKET_BYTES], mc.ModelInput, mc.TYPE_UINT8))
    else:  # one input per tensor that crosses the cut
        cfg.input.extend(_tensor(n, shape, mc.ModelInput, HOP_TYPES[spec.in_dtype])
                         for n, shape in zip(activation_names(ACTIVATION_IN, len(spec.in_shapes)), spec.in_shapes, strict=True))
    # Task inputs besides the image that its parts read, after the hop: the ensemble gives them as the client sent them.
    cfg.input.extend(_side_tensor(s) for s in spec.side_inputs)
    if spec.heads:  # a head pack answers each task on its own output
        cfg.output.extend(_tensor(h.output, spec.out_shape, mc.ModelOutput) for h in spec.heads)
    elif spec.gives_logits or spec.answers_task:  # a chain's tail computes the answer its head gives
        cfg.output.extend(_tensor(o.name, o.shape, mc.ModelOutput, OUTPUT_TYPES[o.dtype]) for o in spec.task_outputs)
    elif tmq:
        cfg.output.append(_tensor(ACTIVATION_OUT, [TICKET_BYTES], mc.ModelOutput, mc.TYPE_UINT8))
    else:
        cfg.output.extend(_tensor(n, shape, mc.ModelOutput, HOP_TYPES[spec.out_dtype])
                          for n, shape in zip(activation_names(ACTIVATION_OUT, len(spec.out_shapes)), spec.out_shapes, strict=True))
    if spec.hand_over is not None:  # a join: the tickets of blocks that handed over directly (ordering only, never read)
        for k in range(spec.hand_over.after):
            extra = _tensor(f"{HANDED_AFTER}_{k}", [TICKET_BYTES], mc.ModelInput, mc.TYPE_UINT8)
            extra.optional = True
            cfg.input.append(extra)
    cfg.instance_group.append(_instance_group(block))
    if block.dynamic_batching:
        cfg.dynamic_batching.max_queue_delay_microseconds = block.batching_delay_us
    # Where the Python backend (r24.10, python_be.cc GetInputTensor) leaves each input:
    # - with FORCE_CPU_ONLY_INPUT_TENSORS=yes, every input reaches the stub in host memory; an
    #   image a client sent in CUDA shared memory is copied to the host by the server, and the
    #   block copies it back to its GPU (a host round trip per request);
    # - with =no, an input in host memory still reaches the stub in host memory, and one in GPU
    #   memory (a CUDA shared-memory region) is copied by the server, GPU to GPU, into the CUDA pool
    #   it shares with the stub, per request (docs/triton-notes.md): the block copies it into its
    #   own memory and waits for that copy before execute returns (backend/device_inputs.py,
    #   ``DeviceInputs.own``), when the server takes the pool's buffer back.
    # So a GPU block that takes the image takes it on the GPU, never through the host. TensorMQ tickets are
    # 256 host bytes: they stay in host memory; so does everything of a CPU block or a
    # triton-cpu plan. So do JPEG/PNG files (uint8 [n, L]): the block parses them on the host (headers,
    # limits) and nvJPEG takes host bytes, so GPU memory would gain nothing. They are not BYTES: the
    # stub's BYTES path (deserialize_bytes_tensor over a NumPy view of the buffer) read wrong bytes and
    # aborted the stub under NumPy 2 (r24.10 stub, H200 machine, 2026-11-29: "unpack_from requires a
    # buffer of at least 1111638598 bytes"), and a client must never be able to crash a stub.
    on_gpu = block.placement != "cpu"
    force_cpu = (spec.transport == "triton-cpu" or not on_gpu or encoded
                 or (spec.transport == "tensormq" and not spec.takes_image))
    cfg.parameters[FORCE_CPU_PARAM].string_value = "yes" if force_cpu else "no"
    cfg.parameters[SPEC_PARAMETER].string_value = spec.to_json()
    return cfg


def _answer(spec: ModelSpec) -> tuple[TaskOutput, ...]:
    """The outputs a step that answers its task names (a detector's, a chain head's); none: LOGITS."""
    return spec.task_outputs if spec.hand_over is not None and spec.hand_over.answered_by else spec.outputs


@dataclass(frozen=True)
class Step:
    """One ensemble step: a model, the spec it runs (for its tensor names) and, for the last step,
    which of its outputs holds the task's logits (a head pack has one per task)."""

    model: str
    spec: ModelSpec
    logits: str = LOGITS


def ensemble_config(name: str, steps: Sequence[Step], image_shape: Sequence[int], logits_shape: Sequence[int],
                    wiring: Wiring | None = None, entry: Sequence[tuple[str, Sequence[int], int]] | None = None,
                    side_inputs: Sequence[SideInput] = ()) -> mc.ModelConfig:
    """The ensemble that chains ``steps``: IMAGE in, LOGITS out, one named tensor per hop.

    ``wiring``: which step's output each step takes, where blocks hand over directly
    (``blockflow.plan.direct_pairs``); by default each takes the step before's. ``entry``: the
    ensemble's inputs (name, dims, type) where it takes no image (a run after a crossing,
    ``blockflow.ensemble_gen.crossing``), which its first step takes by the same names.
    ``side_inputs``: the task's inputs besides the image, taken after it and given, by name, to
    every step whose spec reads them (never carried by a hop)."""
    cfg = mc.ModelConfig()
    cfg.name = name
    cfg.platform = "ensemble"
    cfg.max_batch_size = min(s.spec.max_batch_size for s in steps)
    if entry is None:
        cfg.input.append(_tensor(IMAGE, image_shape, mc.ModelInput, image_type(steps[0].spec)))
    else:
        cfg.input.extend(_tensor(n, dims, mc.ModelInput, t) for n, dims, t in entry)
    cfg.input.extend(_side_tensor(s) for s in side_inputs)
    first = [IMAGE] if entry is None else [n for n, _, _ in entry]
    answer = _answer(steps[-1].spec)  # a detector's outputs; none: LOGITS
    if answer:
        cfg.output.extend(_tensor(o.name, o.shape, mc.ModelOutput, OUTPUT_TYPES[o.dtype]) for o in answer)
    else:
        cfg.output.append(_tensor(LOGITS, logits_shape, mc.ModelOutput))
    given: list[list[str]] = []  # each step's output tensors
    for i, s in enumerate(steps):
        step = cfg.ensemble_scheduling.step.add()
        step.model_name = s.model
        step.model_version = -1
        src = wiring.takes[i] if wiring is not None else (i - 1 if i else None)
        carried = first if src is None else given[src]
        inputs = [IMAGE] if s.spec.takes_image else activation_names(ACTIVATION_IN, len(carried))
        for name, tensor in zip(inputs, carried, strict=True):
            step.input_map[name] = tensor
        for side in s.spec.side_inputs:
            if side not in side_inputs:
                raise ValueError(f"step {s.model} of ensemble {name} reads side input {side.name!r} "
                                 f"({side.dtype} {list(side.shape)}), which the ensemble does not take")
            step.input_map[side.name] = side.name
        for k, j in enumerate(wiring.after.get(i, ()) if wiring is not None else ()):
            step.input_map[f"{HANDED_AFTER}_{k}"] = given[j][0]
        if s.spec.answers_task:
            # The step's output map is also what the step's request asks for: a head pack
            # runs only the heads whose outputs are requested.
            if _answer(s.spec):
                for o in _answer(s.spec):
                    step.output_map[o.name] = o.name
                given.append([o.name for o in _answer(s.spec)])
            else:
                step.output_map[s.logits] = LOGITS
                given.append([LOGITS])
        else:
            # A TensorMQ hop is one ticket tensor whatever it carries; other hops, one per tensor.
            count = 1 if s.spec.transport == "tensormq" else len(s.spec.out_shapes)
            given.append(activation_names(f"hop{i}_{s.model}", count))
            for name, tensor in zip(activation_names(ACTIVATION_OUT, count), given[-1], strict=True):
                step.output_map[name] = tensor
    return cfg


def handed_pairs(cfg: mc.ModelConfig) -> frozenset[tuple[str, str]]:
    """An ensemble's direct hand-overs, as (sender, receiver) model pairs: each step after the first
    that does not take its predecessor's output (nor the image) is keyed by an earlier ticket and
    takes its predecessor's tickets from it directly (:func:`ensemble_config`'s wiring)."""
    steps = cfg.ensemble_scheduling.step
    out = set()
    for prev, step in zip(steps, steps[1:], strict=False):
        taken = {v for k, v in step.input_map.items() if not k.startswith(HANDED_AFTER)}
        if taken and IMAGE not in taken and not taken & set(prev.output_map.values()):
            out.add((prev.model_name, step.model_name))
    return frozenset(out)


def without_hand_overs(cfg: mc.ModelConfig) -> mc.ModelConfig:
    """``cfg`` (an ensemble) with every step taking its predecessor's output, as :func:`ensemble_config`
    wires it without hand-overs: no ``HANDED_AFTER`` inputs, receivers fed by their senders."""
    out = mc.ModelConfig()
    out.CopyFrom(cfg)
    pairs = handed_pairs(cfg)
    steps = out.ensemble_scheduling.step
    for prev, step in zip(steps, steps[1:], strict=False):
        for key in [k for k in step.input_map if k.startswith(HANDED_AFTER)]:
            del step.input_map[key]
        if (prev.model_name, step.model_name) not in pairs:
            continue
        names = activation_names(ACTIVATION_IN, len(step.input_map))
        if sorted(step.input_map) != sorted(names):
            raise ValueError(f"step {step.model_name} of ensemble {cfg.name} takes {sorted(step.input_map)}, "
                             f"not a hop of {ACTIVATION_IN}")
        for name, given in zip(names, activation_names(ACTIVATION_OUT, len(names)), strict=True):
            step.input_map[name] = prev.output_map[given]
    return out


def to_pbtxt(cfg: mc.ModelConfig) -> str:
    return str(text_format.MessageToString(cfg))


def parse_pbtxt(text: str) -> mc.ModelConfig:
    cfg = mc.ModelConfig()
    text_format.Parse(text, cfg)
    return cfg


def config_changes(old: str | mc.ModelConfig, new: str | mc.ModelConfig) -> list[str]:
    """Each field that differs between two configs (``config.pbtxt`` texts or parsed), ``path: old → new``
    (the block's spec parameter compared field by field as ``spec.<field>``; the digest, which follows
    from the rest, left out)."""
    def flat(given: str | mc.ModelConfig) -> dict[str, object]:
        parsed = parse_pbtxt(given) if isinstance(given, str) else given
        cfg = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
        params = cfg.pop("parameters", {})
        params.pop(DIGEST_PARAMETER, None)
        spec = params.pop(SPEC_PARAMETER, None)
        out: dict[str, object] = {}
        _flatten(cfg, "", out)
        _flatten({k: v.get("string_value") for k, v in params.items()}, "parameters.", out)
        if spec is not None:
            _flatten(json.loads(spec["string_value"]), "spec.", out)
        return out

    a, b = flat(old), flat(new)
    return [f"{k}: {a.get(k, '(none)')} → {b.get(k, '(none)')}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _flatten(value: object, prefix: str, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix.rstrip('.')}[{i}].", out)
    else:
        out[prefix.rstrip(".")] = value

