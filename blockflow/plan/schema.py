"""The plan as written: the schema every plan file is checked against (unknown keys are refused).

See ``docs/plan.md`` for the format.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blockflow.core import arch as archs
from blockflow.core import detection, programs
from blockflow.core.spec import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageDtype,
    ImageInput,
    ImageLayout,
    Precision,
    TensorMQSettings,
    TransportName,
)

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
NAME_RULE = "start with a letter; letters, digits, '_' and '-' only; at most 64 characters; no '__' (reserved for generated variants)"

Placement = Literal["auto", "cpu", "gpu"] | list[int]
# How a task's blocks hand over (docs/plan.md, "hand_over").
HandOverMode = Literal["ensemble", "direct", "chain"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputDef(_Strict):
    """How tasks send a model's image: ``dtype`` (float32, normalised by the client; uint8, a
    quarter of the bytes; or encoded, a JPEG or PNG file's bytes, decoded by the first block),
    ``layout`` (CHW: ``[3, H, W]``; HWC: ``[H, W, 3]``, as images decode; encoded images decode to
    CHW) and, for uint8 and encoded, the normalisation the first block applies on its device to
    x / 255: ``imagenet`` (torchvision's mean and std, the default), ``none`` (values in [0, 1]), or
    ``mean`` and ``std`` given per channel (on the [0, 1] scale)."""

    dtype: ImageDtype = "float32"
    layout: ImageLayout = "CHW"
    # A detector's task also takes ORIGINAL_SIZE (int64 [2]: each image's height and width before it was
    # resized to input_shape) and answers boxes in those pixels.
    original_size: bool = False
    normalize: Literal["imagenet", "none"] | None = None
    mean: list[float] | None = Field(default=None, min_length=3, max_length=3)
    std: list[float] | None = Field(default=None, min_length=3, max_length=3)

    @model_validator(mode="after")
    def _one_normalisation(self) -> InputDef:
        if (self.mean is None) != (self.std is None):
            raise ValueError("give mean and std together (three values each, on the [0, 1] scale)")
        if self.mean is not None and self.normalize is not None:
            raise ValueError("give either normalize or mean and std, not both")
        if self.std is not None and not all(v > 0 for v in self.std):
            raise ValueError(f"std {self.std} must be positive")
        if self.dtype == "float32" and (self.mean is not None or self.normalize not in (None, "none")):
            raise ValueError("float32 images arrive normalised by the client; normalize, mean and std are for uint8 "
                             "and encoded")
        if self.dtype == "encoded" and self.layout != "CHW":
            raise ValueError("encoded images (JPEG/PNG bytes) are decoded to CHW by the first block; leave layout out "
                             "(HWC is for uint8 images the client decodes itself)")
        return self

    def spec(self) -> ImageInput | None:
        """What a block that takes the image is told (None for float32 CHW as it is: the default)."""
        normalize = self.normalize or ("none" if self.dtype == "float32" else "imagenet")
        mean, std = (self.mean, self.std) if self.mean is not None else (
            (IMAGENET_MEAN, IMAGENET_STD) if normalize == "imagenet" else ((), ()))
        image = ImageInput(dtype=self.dtype, layout=self.layout, mean=tuple(mean or ()), std=tuple(std or ()))
        return None if image == ImageInput() else image


class ModelDef(_Strict):
    """A base network and where it is cut: a torchvision architecture (``arch``: a classifier, a
    segmentation network, whose output is its ``out`` map of ``[num_classes, H, W]``, or a detector,
    whose outputs are its detections: ``blockflow.core.detection``), the user's own
    model exported with ``torch.export`` (``program``, a ``.pt2`` file relative to the plan file),
    or a model already cut into one file per stage (``stage_files``: ``.pt2`` or TorchScript)."""

    arch: str | None = None
    program: str | None = None
    stage_files: list[str] | None = Field(default=None, min_length=1, max_length=64)
    cut_points: list[str] = Field(default_factory=list)
    input_shape: list[int] = Field(default_factory=lambda: [3, 224, 224])
    num_classes: int = Field(default=1000, ge=1, le=100_000)
    # How tasks send the image (input_shape stays [3, H, W]; with layout HWC the tensor is [H, W, 3];
    # encoded: one file's bytes per image, uint8 [-1] padded to the request's longest, decoded and
    # resized to input_shape by the first block).
    input: InputDef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelDef:
        if [self.arch, self.program, self.stage_files].count(None) != 2:
            raise ValueError("give exactly one of arch (a torchvision model name), program (a .pt2 file saved with "
                             "torch.export.save) or stage_files (one .pt2 or TorchScript file per stage)")
        if self.stage_files is not None:
            given = sorted(self.model_fields_set & {"cut_points", "num_classes"})
            if given:
                raise ValueError(f"{' and '.join(given)} come(s) from the stage files; leave "
                                 f"{'them' if len(given) > 1 else 'it'} out")
        if self.program is not None:
            given = sorted(self.model_fields_set & {"input_shape", "num_classes"})
            if given:
                raise ValueError(f"{' and '.join(given)} come(s) from the exported program; leave "
                                 f"{'them' if len(given) > 1 else 'it'} out")
        if self.original_size and not (self.arch is not None and detection.is_detection(self.arch)):
            raise ValueError("input.original_size is for torchvision's detectors (it puts their boxes in the original "
                             "image's pixels); an exported program takes such an input as an argument of its own")
        return self

    @field_validator("program")
    @classmethod
    def _program_file(cls, v: str | None) -> str | None:
        if v is not None and not programs.is_program(v):
            raise ValueError(f"program {v!r} is not a {programs.PROGRAM_SUFFIX} file; save the model with "
                             "torch.export.save(torch.export.export(model, (x,), ...), 'model.pt2')")
        return v

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str | None) -> str | None:
        if v is None:
            return v
        known = archs.supported_archs()
        if v not in known:
            near = difflib.get_close_matches(v, known, n=3)
            hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
            raise ValueError(f"unknown architecture {v!r}; {hint}any torchvision classification, semantic segmentation "
                             "or detection model works (torchvision.models.list_models(module=torchvision.models), "
                             "and module=torchvision.models.segmentation or .detection; Keypoint R-CNN aside)")
        return v

    @field_validator("input_shape")
    @classmethod
    def _sane_input(cls, v: list[int]) -> list[int]:
        if len(v) != 3 or v[0] != 3 or not (32 <= v[1] <= 4096 and 32 <= v[2] <= 4096):
            raise ValueError(f"input_shape {list(v)} is not [3, H, W] with 32 <= H, W <= 4096")
        return v

    @property
    def original_size(self) -> bool:
        """Whether the model's tasks take each image's original size (a detector's ORIGINAL_SIZE)."""
        return self.input is not None and self.input.original_size

    @property
    def image(self) -> ImageInput | None:
        """The image input blocks that take it are told about (None: float32 CHW, as the network takes it)."""
        return self.input.spec() if self.input is not None else None

    @property
    def image_shape(self) -> tuple[int, ...]:
        """Per-sample shape of the image tensor a task takes."""
        image = self.image
        return image.shape(tuple(self.input_shape)) if image is not None else tuple(self.input_shape)

    @property
    def stage_count(self) -> int:
        return len(self.stage_files) if self.stage_files is not None else len(self.cut_points) + 1

    @property
    def network(self) -> str:
        """What ``blockflow.core.arch`` builds: the torchvision name, or the program's path (absolute
        once the plan resolved it, see ``Plan.models``); empty for stage files."""
        return self.arch if self.arch is not None else str(self.program or "")


class Weights(_Strict):
    """Exactly one of ``seed`` (deterministic random weights), ``file`` (a state dict) or ``torchvision``
    (the name of torchvision's trained weights for the model, as its weights API names them: ``IMAGENET1K_V2``,
    ``DEFAULT``); an exported program's blocks may leave all out and run the program's own weights."""

    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    file: str | None = None
    torchvision: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_]{1,64}$")


class BlockSettings(_Strict):
    """Settings a block may set and ``defaults`` may set for all blocks."""

    placement: Placement | None = None
    instances: int | None = Field(default=None, ge=1, le=64)
    max_batch_size: int | None = Field(default=None, ge=1, le=1024)
    batching_delay_us: int | None = Field(default=None, ge=0, le=1_000_000)
    # False: no Triton dynamic batcher; each request runs alone, one thread hand-off less per step.
    dynamic_batching: bool | None = None
    precision: Precision | None = None
    cuda_graphs: bool | None = None
    # Seconds between the block monitor's samples (GPU/CPU memory, utilisation, power); 0 turns it off.
    monitor_period_s: float | None = Field(default=None, ge=0, le=3600)


DEFAULT_SETTINGS: dict[str, Any] = {
    "placement": "auto",
    "instances": 1,
    "max_batch_size": 8,
    "batching_delay_us": 100,
    "dynamic_batching": True,
    "precision": "fp32",
    "cuda_graphs": True,
    "monitor_period_s": 2.0,
}


class BlockDef(BlockSettings):
    """A block: a contiguous stage range of one model, with its own weights."""

    model: str
    stages: int | tuple[int, int]
    # None: seed 0 for a torchvision model, the program's own weights for an exported one.
    weights: Weights | None = None
    # The server it runs on, in a plan that names its servers (None: the first server listed).
    server: str | None = None


class ServerDef(_Strict):
    """One server of a plan that spans several (``servers``): where the servers before it on a
    task's path reach its gRPC endpoint (``host:port``), and how long a request that crosses to it
    may take there before the crossing fails it."""

    grpc: str = Field(pattern=r"^[A-Za-z0-9.\[\]:_-]+:[0-9]{1,5}$")
    timeout_s: float = Field(default=10.0, gt=0, le=600)


class TaskDef(_Strict):
    """A task: the path of blocks its requests take, first stage to last."""

    path: list[str] = Field(min_length=1)
    transport: TransportName | None = None
    # The plan's ``hand_over`` for this task alone (a block both kinds of tasks run keeps its steps).
    hand_over: HandOverMode | None = None


class PlanModel(_Strict):
    """The plan as written (fields checked, graph not yet)."""

    version: Literal[1]
    name: str = "blockflow"
    models: dict[str, ModelDef] = Field(min_length=1)
    defaults: BlockSettings = BlockSettings()
    blocks: dict[str, BlockDef] = Field(min_length=1)
    tasks: dict[str, TaskDef] = Field(min_length=1)
    transport: TransportName = "tensormq"
    compare: list[TransportName] = Field(default_factory=list)
    references: list[Literal["eager", "graph"]] = Field(default_factory=list)
    # Instances of each task's unsplit (non-fp32) references; None: as many as the task's first block,
    # so the same number of processes ingests images on both sides of a comparison. Set it to compare a
    # split whose first block runs fewer instances with the unsplit model at its best.
    reference_instances: int | None = Field(default=None, ge=1, le=64)
    # auto: consecutive blocks that exactly the same tasks traverse (with the same deployment
    # settings) run as one model: one process and one hop fewer per fused pair.
    fuse: Literal["none", "auto"] = "none"
    # heads: the heads of tasks that branch off after the same deployed block (each the last,
    # task-specific part of its path) run as one model: one process for all of them. all: heads,
    # and the whole models of tasks that share no block (a path that is one deployed model), deployed
    # alike, too. One switch ordered by reach rather than a key per kind: both kinds trade the same
    # thing (a process's memory for members running one after another) and a plan that packs whole
    # models for memory wants its heads packed as well.
    pack: Literal["none", "heads", "all"] = "none"
    # The most members one pack holds: a group of more is split into packs of nearly equal size. A
    # pack runs a call's members one after another, so this bounds how long one call can take.
    pack_size: int = Field(default=8, ge=2, le=64)
    # direct: on TensorMQ paths, a block whose only next block is one whose only block before it
    # is this one hands its tickets to that block directly, and the ensemble runs both at once:
    # one ensemble step fewer per such pair (docs/plan.md, "hand_over"). chain: such blocks are no
    # steps at all: each runs what the block before it hands it and hands on (docs/plan.md, "Chains").
    hand_over: HandOverMode = "ensemble"
    # Who answers a chain's tasks where the chain runs to their last block (docs/plan.md, "Chains"):
    # join: that block is an ensemble step after the head's, as where a chain ends before its tasks'
    # last block; head: that block is a link too (the *tail*), and the chain's head waits in its call
    # for what the tail sends back and answers with it, so the ensemble runs one step for the chain.
    chain_answers: Literal["join", "head"] = "join"
    tensormq: TensorMQSettings = TensorMQSettings()
    # The servers a plan spans (blockflow.plan.crossing): each serves its blocks, and a task whose
    # path goes on to another server's blocks crosses to it over Triton's gRPC. Empty: one server.
    servers: dict[str, ServerDef] = Field(default_factory=dict)

