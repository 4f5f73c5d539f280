"""torchvision's object detectors as networks BlockFlow can cut: the backbone (and its FPN) traced,
the rest (heads, anchors, region proposals, NMS, mask pasting) run eagerly in one graph node.

A detector is wrapped as :class:`DetectionNet`: it takes ``[B, 3, H, W]`` images and gives its
detections as batch-first tensors (:data:`OUTPUT_ORDER`): ``COUNT`` ``[B, 1]`` (int64, detections
per image), ``BOXES`` ``[B, N, 4]`` (x1, y1, x2, y2 in input pixels), ``SCORES`` ``[B, N]``, ``LABELS``
``[B, N]`` (int64) and, for Mask R-CNN, ``MASKS`` ``[B, N, H, W]`` (probabilities), where ``N`` is
the largest count in the batch (at least 1); rows past an image's count are padding (zeros, label -1).

The wrapper holds the detector's own submodules under their own names, so a state dict of the
torchvision model fits. Its contract is the traced part's: the image arrives at the plan's input
size, normalised as the plan's ``input`` says (the detector's own ``GeneralizedRCNNTransform`` is
built as an identity: mean 0, std 1, and its resize bounds are the input size) and is neither
resized nor padded; boxes are in its pixels. The eager part is one ``call_function`` node
(``torch.fx.wrap``): a cut can fall anywhere before it (inside the backbone, or after the FPN, whose
levels a hop carries), never inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import fx, nn

from blockflow.core.spec import BOXES, COUNT, LABELS, MASKS, SCORES

OUTPUT_ORDER = (COUNT, BOXES, SCORES, LABELS, MASKS)
# Each output's per-detection shape (after the detection axis) and dtype; MASKS is [H, W].
_PER_DETECTION: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    BOXES: ((4,), torch.float32), SCORES: ((), torch.float32), LABELS: ((), torch.int64)}
PAD_LABEL = -1


@lru_cache(maxsize=1)
def detection_archs() -> frozenset[str]:
    """torchvision's detectors BlockFlow serves (Faster and Mask R-CNN, RetinaNet, FCOS, SSD).
    Keypoint R-CNN is not among them: its keypoints are no output BlockFlow declares."""
    import torchvision.models as tvm

    return frozenset(n for n in tvm.list_models(module=tvm.detection) if not n.startswith("keypointrcnn"))


def is_detection(arch: str) -> bool:
    return arch in detection_archs()


def gives_masks(arch: str) -> bool:
    return arch.startswith("maskrcnn")


def output_names(arch: str) -> tuple[str, ...]:
    """The task outputs of detector ``arch``, in the order the network gives them."""
    return tuple(n for n in OUTPUT_ORDER if n != MASKS or gives_masks(arch))


def factory_kwargs(arch: str, input_shape: Sequence[int]) -> dict[str, Any]:
    """What ``torchvision.models.get_model`` is given for ``arch`` besides weights and classes:
    no backbone weights (torchvision would download them) and an identity transform at this size."""
    h, w = int(input_shape[-2]), int(input_shape[-1])
    kwargs: dict[str, Any] = {"weights_backbone": None, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0]}
    if not arch.startswith("ssd"):  # an SSD resizes to its own fixed size (its name says which)
        kwargs.update(min_size=min(h, w), max_size=max(h, w))
    return kwargs


def max_detections(model: nn.Module) -> int:
    """The most detections the detector gives per image."""
    roi_heads = getattr(model, "roi_heads", None)
    holder: Any = roi_heads if roi_heads is not None else model
    return int(holder.detections_per_img)


class DetectionNet(nn.Module):
    """A torchvision detector as a traceable network (see the module docstring)."""

    # The detector's own children (which of them depends on its family).
    backbone: Any
    rpn: Any
    roi_heads: Any
    transform: Any
    head: Any
    anchor_generator: Any
    post: Any

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.image_hw = (int(input_shape[-2]), int(input_shape[-1]))
        self.masks = hasattr(model, "roi_heads") and getattr(model.roi_heads, "has_mask", lambda: False)()
        self.limit = max_detections(model)
        self.rcnn = hasattr(model, "rpn")
        if not self.rcnn:
            self.post = _DensePost(model)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features = self.backbone(images)
        if self.rcnn:
            return detect_rcnn(self.rpn, self.roi_heads, self.transform, self.image_hw, self.limit, self.masks,
                               tuple(features.keys()), *features.values())
        return detect_dense(self.head, self.anchor_generator, self.transform, self.post, self.image_hw,
                            self.limit, *features.values())


class _DensePost(nn.Module):
    """A dense detector's postprocessing (RetinaNet, FCOS, SSD): its class's ``postprocess_detections``
    with the settings it reads (box coder, thresholds, limits), without the model's weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.box_coder = model.box_coder
        for name in ("detections_per_img", "nms_thresh", "score_thresh", "topk_candidates"):
            setattr(self, name, getattr(model, name))
        self.dense_split = type(model).__name__ != "SSD"  # RetinaNet and FCOS give outputs per pyramid level
        self._postprocess: Any = type(model).postprocess_detections  # type: ignore[attr-defined]

    def postprocess_detections(self, *args: Any) -> Any:
        return self._postprocess(self, *args)


def _image_list(features: Sequence[torch.Tensor], image_hw: tuple[int, int]) -> Any:
    from torchvision.models.detection.image_list import ImageList

    batch = int(features[0].shape[0])
    # Anchors read only the images' size, device and dtype: a view of one zero, no memory.
    tensors = features[0].new_zeros(1, 1, 1, 1).expand(batch, 3, *image_hw)
    return ImageList(tensors, [image_hw] * batch)


def _meta_outputs(features: Sequence[torch.Tensor], image_hw: tuple[int, int], limit: int, masks: bool) -> tuple[torch.Tensor, ...]:
    """What the eager part gives on the meta device (shape propagation): at most ``limit`` detections."""
    batch, dev = int(features[0].shape[0]), features[0].device
    outs = [torch.empty((batch, 1), dtype=torch.int64, device=dev)]
    outs += [torch.empty((batch, limit, *shape), dtype=dtype, device=dev) for shape, dtype in _PER_DETECTION.values()]
    if masks:
        outs.append(torch.empty((batch, limit, *image_hw), dtype=torch.float32, device=dev))
    return tuple(outs)


def padded(detections: Sequence[dict[str, torch.Tensor]], masks: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-image detections as batch-first tensors padded to the batch's largest count (at least 1)."""
    counts = [int(d["boxes"].shape[0]) for d in detections]
    n = max(1, *counts) if counts else 1
    batch = len(detections)
    out = [torch.tensor(counts, dtype=torch.int64, device=device).reshape(batch, 1)]
    keys = [("boxes", BOXES), ("scores", SCORES), ("labels", LABELS)] + ([("masks", MASKS)] if masks else [])
    for key, name in keys:
        if name == MASKS:
            per = [d["masks"][:, 0] for d in detections]  # [k, 1, H, W] -> [k, H, W]
            shape, dtype = tuple(per[0].shape[1:]), torch.float32
        else:
            per = [d[key] for d in detections]
            shape, dtype = _PER_DETECTION[name]
        fill = PAD_LABEL if name == LABELS else 0
        t = torch.full((batch, n, *shape), fill, dtype=dtype, device=device)
        for i, v in enumerate(per):
            t[i, :v.shape[0]] = v.to(dtype)
        out.append(t)
    return tuple(out)


def detect_rcnn(rpn: Any, roi_heads: Any, transform: Any, image_hw: tuple[int, int], limit: int,
                masks: bool, keys: tuple[str, ...], *features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Faster and Mask R-CNN after the backbone, as ``GeneralizedRCNN.forward`` runs it in eval mode."""
    if features[0].device.type == "meta":
        return _meta_outputs(features, image_hw, limit, masks)
    from collections import OrderedDict

    images = _image_list(features, image_hw)
    feats = OrderedDict(zip(keys, features, strict=True))
    proposals, _ = rpn(images, feats)
    detections, _ = roi_heads(feats, proposals, images.image_sizes)
    detections = transform.postprocess(detections, images.image_sizes, images.image_sizes)  # pastes masks
    return padded(detections, masks, features[0].device)


def detect_dense(head: Any, anchor_generator: Any, transform: Any, post: _DensePost,
                 image_hw: tuple[int, int], limit: int, *features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RetinaNet, FCOS and SSD after the backbone, as their ``forward`` runs it in eval mode."""
    if features[0].device.type == "meta":
        return _meta_outputs(features, image_hw, limit, False)
    feats = list(features)
    images = _image_list(feats, image_hw)
    head_outputs = head(feats)
    anchors = anchor_generator(images, feats)
    if not post.dense_split:
        detections = post.postprocess_detections(head_outputs, anchors, images.image_sizes)
    else:
        per_level = [x.size(2) * x.size(3) for x in feats]
        a = head_outputs["cls_logits"].size(1) // sum(per_level)
        per_level = [hw * a for hw in per_level]
        split_outputs = {k: list(v.split(per_level, dim=1)) for k, v in head_outputs.items()}
        split_anchors = [list(x.split(per_level)) for x in anchors]
        detections = post.postprocess_detections(split_outputs, split_anchors, images.image_sizes)
    detections = transform.postprocess(detections, images.image_sizes, images.image_sizes)
    return padded(detections, False, features[0].device)


# The largest ORIGINAL_SIZE side a task takes (a million pixels): boxes scaled by more would lose their precision.
MAX_ORIGINAL_SIDE = 1_000_000


def in_original_pixels(outputs: Sequence[torch.Tensor], sizes: torch.Tensor, input_shape: Sequence[int]) -> list[torch.Tensor]:
    """A detector's outputs (:data:`OUTPUT_ORDER`) with each image's boxes scaled from the network's input
    (``input_shape``'s height and width) to its original size (``sizes``: ``[B, 2]`` height, width)."""
    h, w = int(input_shape[-2]), int(input_shape[-1])
    boxes = outputs[1]
    # Checked where they arrive in host memory; on a GPU held in range instead (no wait for the device).
    hw = sizes.clamp(1, MAX_ORIGINAL_SIDE).to(device=boxes.device, dtype=boxes.dtype)
    scale = torch.stack([hw[:, 1] / w, hw[:, 0] / h, hw[:, 1] / w, hw[:, 0] / h], dim=1)
    return [outputs[0], boxes * scale[:, None, :], *outputs[2:]]


fx.wrap("detect_rcnn")
fx.wrap("detect_dense")
# The eager node a traced detector ends in (one of these functions, called once).
EAGER_NODES = (detect_rcnn, detect_dense)


def build(arch: str, num_classes: int, input_shape: Sequence[int]) -> DetectionNet:
    """Detector ``arch`` (torchvision's initialisation under the caller's seed) as a :class:`DetectionNet`.

    A RetinaNet's or FCOS's classification bias starts at torchvision's prior (scores near 0.01,
    below its 0.05 threshold): drawn weights would detect nothing, so it starts at 0 (scores near
    0.5). Weights loaded later (a file, torchvision's trained ones) replace it."""
    import torchvision.models as tvm

    model = tvm.get_model(arch, weights=None, num_classes=num_classes, **factory_kwargs(arch, input_shape))
    cls_logits = getattr(getattr(getattr(model, "head", None), "classification_head", None), "cls_logits", None)
    if isinstance(cls_logits, nn.Conv2d) and cls_logits.bias is not None and cls_logits.bias.device.type != "meta":
        with torch.no_grad():
            cls_logits.bias.zero_()
    return DetectionNet(model.eval(), input_shape)


def task_outputs(arch: str, input_shape: Sequence[int]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """(name, dtype, per-sample shape with -1 for the detection axis) of each output of detector ``arch``."""
    out: list[tuple[str, str, tuple[int, ...]]] = [(COUNT, "int64", (1,))]
    for name, (shape, dtype) in _PER_DETECTION.items():
        out.append((name, "int64" if dtype == torch.int64 else "fp32", (-1, *shape)))
    if gives_masks(arch):
        out.append((MASKS, "fp32", (-1, int(input_shape[-2]), int(input_shape[-1]))))
    return tuple(out)
