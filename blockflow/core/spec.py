"""What one generated Triton model runs: the contract between generator and block runtime.

The generator writes a :class:`ModelSpec` as canonical JSON into the model's
``config.pbtxt`` (parameter ``blockflow.spec``), so the server's own config API
shows exactly what each model runs and ``blockflow apply`` can diff it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Precision = Literal["fp32", "tf32", "fp16", "bf16"]
# What a hop between two blocks carries: the precision of the block before it (tf32 computes in fp32).
HopDtype = Literal["fp32", "fp16", "bf16"]


def hop_dtype(precision: Precision) -> HopDtype:
    """The dtype of the tensors a block of ``precision`` hands to the next block."""
    return "fp16" if precision == "fp16" else "bf16" if precision == "bf16" else "fp32"
TransportName = Literal["tensormq", "triton-gpu", "triton-cpu"]
# How a task's image arrives: its element type (``encoded``: a JPEG or PNG file's bytes, one row of a
# Triton UINT8 ``[n, L]`` tensor per image, zero-padded to the longest) and axis order (CHW:
# ``[3, H, W]``, HWC: ``[H, W, 3]``).
ImageDtype = Literal["float32", "uint8", "encoded"]
ImageLayout = Literal["CHW", "HWC"]
# torchvision's ImageNet normalisation (on [0, 1] values), what its trained classifiers expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TRANSPORTS: tuple[TransportName, ...] = ("tensormq", "triton-gpu", "triton-cpu")

SPEC_PARAMETER = "blockflow.spec"

# Tensor names every generated model uses. Task ensembles take IMAGE and give LOGITS,
# so a client never sees how a task is split.
IMAGE = "IMAGE"
# A detector task's optional side input (plan ``input: {original_size: true}``): each image's height and
# width before the client resized it to the network's input, int64 [2]; its boxes come back in those pixels.
ORIGINAL_SIZE = "ORIGINAL_SIZE"
LOGITS = "LOGITS"
# A detector task's outputs instead (blockflow.core.detection): detections per image, and each
# detection's box, score, label and (Mask R-CNN) mask, padded along the detection axis.
COUNT, BOXES, SCORES, LABELS, MASKS = "COUNT", "BOXES", "SCORES", "LABELS", "MASKS"
ACTIVATION_IN = "ACTIVATION_IN"
ACTIVATION_OUT = "ACTIVATION_OUT"
TICKET_BYTES = 256
# The most bytes of one sample's answer that a chain's tail sends back to its head (one message of a
# datagram, ``backend/tensormq/wire.py``): a task whose answer is larger (a segmenter's masks), or
# varies (a detector's), keeps its chain's join.
ANSWER_MAX = 32768
# A join's optional inputs: the tickets of the blocks before it that handed over directly (their
# outputs reach no other step, and Triton runs only the steps whose outputs some step takes).
HANDED_AFTER = "HANDED_AFTER"


def activation_names(base: str, count: int) -> list[str]:
    """Triton tensor names of a hop of ``count`` tensors: ``base``, then ``base_1``, ``base_2``, ..."""
    return [base if i == 0 else f"{base}_{i}" for i in range(count)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WeightsSource(_Strict):
    """Where a part's weights come from: a seed, a state-dict file keyed like the full torchvision model, or
    torchvision's trained weights of that name (its weights API's canonical name, ``IMAGENET1K_V2``)."""

    seed: int | None = None
    file: str | None = None
    torchvision: str | None = None


class ImageInput(_Strict):
    """How a task's image arrives and what a block that takes it does first, on its device (inside
    its CUDA graph): uint8 values scaled to [0, 1] (x / 255), HWC permuted to CHW, then
    ``(x - mean) / std`` per channel where ``mean`` and ``std`` are given. An ``encoded`` image is
    decoded (and resized to the network's size) in ``execute`` first, then taken as uint8 CHW."""

    dtype: ImageDtype = "float32"
    layout: ImageLayout = "CHW"
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def shape(self, chw: tuple[int, ...]) -> tuple[int, ...]:
        """The image tensor's per-sample shape for a network that takes ``chw`` (``[3, H, W]``):
        ``[-1]`` for encoded images (one file's bytes, padded to the request's longest)."""
        if self.dtype == "encoded":
            return (-1,)
        return (*chw[1:], chw[0]) if self.layout == "HWC" else tuple(chw)


# The element type of a task output other than logits (a detector's counts and labels are int64).
OutputDtype = Literal["fp32", "int64"]


# A task input other than the image (a side input): its element type.
SideDtype = Literal["fp32", "int64"]


class SideInput(_Strict):
    """A task input other than the image (an exported program's further argument, named by it): its
    Triton name, element type and per-sample shape. It travels from the task's ensemble straight to
    every block whose stages read it, never across a hop, so it keeps its dtype on every transport."""

    name: str
    dtype: SideDtype
    shape: tuple[int, ...]


class TaskOutput(_Strict):
    """One output a task answers with: its name, element type and per-sample shape, ``-1`` where
    it varies (a detector's detections: padded per request to its largest count, see
    ``blockflow.core.detection``)."""

    name: str
    dtype: OutputDtype
    shape: tuple[int, ...]

    @property
    def sample_bytes(self) -> int | None:
        """Bytes of one sample's value; None where its shape varies."""
        if any(d < 0 for d in self.shape):
            return None
        n = 8 if self.dtype == "int64" else 4
        for d in self.shape:
            n *= d
        return n


BRIDGE_PARAMETER = "blockflow.bridge"


class BridgeSpec(_Strict):
    """What a crossing model runs (``blockflow.backend.bridge``, ``blockflow.plan.crossing``): each
    request's tensors sent to ensemble ``model`` of the server at ``grpc``, its answer given back."""

    grpc: str
    model: str
    timeout_s: float
    inputs: tuple[tuple[str, HopDtype], ...]
    outputs: tuple[str, ...]
    # The most samples one call to ``model`` may carry: the requests a call of the crossing batches
    # are sent together up to it (0: each request on its own, as for a detector's ragged outputs).
    max_batch_size: int = Field(default=0, ge=0)


class PartNetwork(_Strict):
    """The network a part is cut from where it is not its spec's: a path that goes on from one
    model's block to another's (a shared backbone) runs, unsplit, parts of both."""

    arch: str
    cut_points: tuple[str, ...]
    num_classes: int
    input_shape: tuple[int, ...]
    stage_files: tuple[str, ...] = ()


class Part(_Strict):
    """Stages ``first..last`` (inclusive) of the base network (``network``'s, where given), with their weights."""

    block: str
    first: int
    last: int
    weights: WeightsSource
    network: PartNetwork | None = None
    # Its own precision where its block's is not the spec's: the unsplit reference of a path whose
    # blocks differ (fp16 stages, then a detector's fp32 heads) runs each part as its block does.
    precision: Precision | None = None
    # The side inputs (names among the spec's ``side_inputs``) its stages read, in the order they
    # take them after the tensors that enter the part.
    side_inputs: tuple[str, ...] = ()


class Head(_Strict):
    """One task's head inside a head pack: its parts, answered on output ``LOGITS__<task>``."""

    task: str
    parts: tuple[Part, ...] = Field(min_length=1)

    @property
    def output(self) -> str:
        return head_output(self.task)


def head_output(task: str) -> str:
    """The output tensor of ``task``'s head in a head pack."""
    return f"{LOGITS}__{task}"


CLAIM_S = 10.0


class TensorMQSettings(_Strict):
    """Pool and protocol settings of every TensorMQ producer in a plan."""

    pool_mb: int = Field(default=256, ge=1, le=65536)
    slots: int = Field(default=64, ge=1, le=4096)
    lease_s: float = Field(default=30.0, gt=0, le=3600)
    wait_s: float = Field(default=5.0, ge=0, le=600)
    # How long a ticket may wait to be accepted by the next block; past it the ticket is refused
    # and its sample reclaimed (tickets that left the ensemble hold no memory for the whole lease).
    # None: the smaller of CLAIM_S and lease_s.
    claim_s: float | None = Field(default=None, gt=0, le=3600)

    @model_validator(mode="after")
    def _claim_within_lease(self) -> TensorMQSettings:
        if self.claim_s is not None and self.claim_s > self.lease_s:
            raise ValueError(f"claim_s ({self.claim_s:g}) must not exceed lease_s ({self.lease_s:g})")
        return self

    @property
    def claim_window_s(self) -> float:
        return self.claim_s if self.claim_s is not None else min(CLAIM_S, self.lease_s)


class HandOver(_Strict):
    """A block's part in direct hand-overs (plan option ``hand_over: direct``, see
    ``blockflow.backend.tensormq.handover``): each field is empty where the block plays no part."""

    # The next block, which takes this block's tickets from it directly instead of from the ensemble.
    to: str = ""
    # The block this one takes its tickets from directly; the ensemble gives it, as a key, the
    # ticket that block was given (one of ``keys_from``'s).
    takes_from: str = ""
    keys_from: tuple[str, ...] = ()
    # How many optional HANDED_AFTER inputs this block (a join) takes.
    after: int = 0
    # Chains (plan option ``hand_over: chain``): a *link* is no ensemble step; it runs every hand-over
    # it is sent and hands its own tickets on under the same key. A chain's head keys its hand-overs by
    # its own tickets (``own_keys``), and a block whose ``to`` is a link sends each call to one of its
    # instances (``to_link``).
    link: bool = False
    own_keys: bool = False
    to_link: bool = False
    # A chain's join: its hand-overs come from a link, hops after its key (the head's ticket) was claimed.
    from_link: bool = False
    # A chain that ends its tasks (plan option ``chain_answers: head``): its last block is a link too, the
    # *tail*, and sends each sample's answer back to the head instance that took its request
    # (``tail``); the head (``answered_by``: the tail) answers the request with it, as the ensemble's
    # only step of the chain.
    tail: bool = False
    answered_by: str = ""
    # What the head answers with: its tail's task outputs.
    answer: tuple[TaskOutput, ...] = ()


_CHAIN_FIELDS = ("link", "own_keys", "to_link", "from_link", "tail", "answered_by", "answer")


class ModelSpec(_Strict):
    """Everything a block process needs to build and run its model."""

    kind: Literal["block", "reference", "pack"]
    name: str
    arch: str
    cut_points: tuple[str, ...]
    num_classes: int
    input_shape: tuple[int, ...]
    parts: tuple[Part, ...] = Field(min_length=1)
    precision: Precision
    cuda_graphs: bool
    max_batch_size: int
    transport: TransportName
    # Per-sample shape of the first input as it arrives: for a model that takes the image, the
    # image's (``[H, W, 3]`` where ``image.layout`` is HWC).
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    # A hop that carries several tensors (values live across the cut, e.g. a skip connection): the
    # shapes of those after the first, in the network's order.
    extra_in_shapes: tuple[tuple[int, ...], ...] = ()
    extra_out_shapes: tuple[tuple[int, ...], ...] = ()
    # The dtypes of the hops into and out of this model (``hop_dtype`` of the block before, of its
    # own). A task's logits are always fp32; its image is fp32 unless ``image`` says otherwise.
    in_dtype: HopDtype = "fp32"
    out_dtype: HopDtype = "fp32"
    # A model already cut into files (blockflow.plan ``stage_files``): stage i runs file i, with
    # its own weights; ``arch`` is empty and ``cut_points`` unused.
    stage_files: tuple[str, ...] = ()
    tensormq: TensorMQSettings | None = None
    monitor_period_s: float = 0.0
    # A head pack (kind "pack") runs several tasks' heads in one process: ``parts`` is the first
    # head's, and every head covers the same stages (see blockflow.plan.HeadPack).
    heads: tuple[Head, ...] = ()
    # TensorMQ consumers: the Triton models whose tickets this model accepts (the blocks before it
    # on some task's path); a ticket from any other block is refused as redirected.
    accepts_from: tuple[str, ...] = ()
    hand_over: HandOver | None = None
    # A model that takes the image, where the plan's model gives a non-default input (uint8, HWC, normalised).
    image: ImageInput | None = None
    # What the last block of a task whose network is no classifier answers with (a detector's
    # COUNT, BOXES, ...); empty: LOGITS of ``out_shape``.
    outputs: tuple[TaskOutput, ...] = ()
    # The task inputs besides the image that this model's parts read (each part names its own), taken
    # after its hop tensors (the image, or what crosses its cut), in this order.
    side_inputs: tuple[SideInput, ...] = ()

    @model_validator(mode="after")
    def _pack_has_heads(self) -> ModelSpec:
        if (self.kind == "pack") != bool(self.heads):
            raise ValueError("a spec has heads exactly when its kind is 'pack'")
        names = {s.name for s in self.side_inputs}
        for part in [*self.parts, *(p for h in self.heads for p in h.parts)]:
            unknown = set(part.side_inputs) - names
            if unknown:
                raise ValueError(f"part of block {part.block!r} reads side input(s) {sorted(unknown)} the spec does not take")
        return self

    def head_specs(self) -> list[tuple[str, ModelSpec]]:
        """(output name, single-chain spec) for each head of a pack."""
        return [(h.output, self.model_copy(update={"kind": "block", "name": f"{self.name}/{h.task}", "parts": h.parts, "heads": ()}))
                for h in self.heads]

    @property
    def first_stage(self) -> int:
        return self.parts[0].first

    @property
    def last_stage(self) -> int:
        return self.parts[-1].last

    @property
    def in_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-sample shape of every tensor the model takes."""
        return (self.in_shape, *self.extra_in_shapes)

    @property
    def out_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-sample shape of every tensor the model gives (each head's, in a pack)."""
        return (self.out_shape, *self.extra_out_shapes)

    @property
    def takes_image(self) -> bool:
        return self.first_stage == 0

    @property
    def stage_count(self) -> int:
        return len(self.stage_files) if self.stage_files else len(self.cut_points) + 1

    @property
    def gives_logits(self) -> bool:
        """Whether this model runs its network's last stage (answers the task: LOGITS, or ``outputs``)."""
        return self.last_stage == self.stage_count - 1

    @property
    def answers_early(self) -> bool:
        """Whether a call of one request may answer with its tickets before queuing its GPU work, so the
        answer overlaps the ensemble's scheduling of the next step: a block that is no sender of direct
        hand-overs, no link and no pack of heads. A sender (a chain's head among them) answers after its
        commit, as the block it hands over to waits for that commit and the answer's round trip (~0.2 ms)
        would come first; a link answers nobody; a pack of heads answers with logits."""
        role = self.hand_over
        return not self.heads and not (role is not None and (role.link or bool(role.to)))

    @property
    def answers_task(self) -> bool:
        """Whether its response is the task's answer (``task_outputs``): it runs the network's last stage
        and is no chain's tail, or it is the head of a chain whose tail answers through it."""
        role = self.hand_over
        if role is not None and role.answered_by:
            return True
        return self.gives_logits and not (role is not None and role.tail)

    @property
    def task_outputs(self) -> tuple[TaskOutput, ...]:
        """What the task's answer holds where this model gives it (a chain's head: what its tail gives)."""
        if self.hand_over is not None and self.hand_over.answered_by:
            return self.hand_over.answer
        return self.outputs or (TaskOutput(name=LOGITS, dtype="fp32", shape=self.out_shape),)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): same spec, same bytes."""
        import json

        # Optional fields are left out when empty, so a spec that uses none of them keeps its bytes (and digest).
        optional = ("heads", "accepts_from", "extra_in_shapes", "extra_out_shapes", "stage_files", "hand_over", "image",
                    "outputs", "side_inputs")
        omitted = {k for k in optional if not getattr(self, k)} | {k for k in ("in_dtype", "out_dtype") if getattr(self, k) == "fp32"}
        data = self.model_dump(mode="json", exclude=omitted)
        for part in [*data["parts"], *(p for h in data.get("heads", ()) for p in h["parts"])]:
            if part["weights"]["torchvision"] is None:  # as above: specs without trained weights keep their bytes
                del part["weights"]["torchvision"]
            if part["network"] is None:
                del part["network"]
            if part["precision"] is None:
                del part["precision"]
            if not part["side_inputs"]:
                del part["side_inputs"]
        if "hand_over" in data:  # a chain's fields, where false or empty (direct hand-overs keep their bytes)
            data["hand_over"] = {k: v for k, v in data["hand_over"].items() if k not in _CHAIN_FIELDS or v}
        return json.dumps(data, sort_keys=True, separators=(",", ":"))
