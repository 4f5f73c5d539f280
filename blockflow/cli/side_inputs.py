"""What ``blockflow infer`` sends besides the images, a task's side inputs (``--input NAME=FILE.npy``),
and how it prints the answer of a task that gives named outputs (neither LOGITS nor a detector's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from blockflow.cli.app import emit, out

if TYPE_CHECKING:
    from blockflow.clients.task_input import TaskInput


def files(given: tuple[str, ...]) -> dict[str, Any]:
    """``--input NAME=FILE.npy`` values: each file's array by name."""
    import numpy as np

    arrays: dict[str, Any] = {}
    for item in given:
        name, eq, file = item.partition("=")
        if not eq or not name or not file:
            raise click.BadParameter(f"{item!r} is not NAME=FILE.npy", param_hint="--input")
        if name in arrays:
            raise click.BadParameter(f"{name!r} is given twice", param_hint="--input")
        try:
            arrays[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:  # missing, unreadable, not a .npy of plain numbers
            raise click.BadParameter(f"cannot read {file} for {name!r}: {exc}", param_hint="--input") from None
    return arrays


def with_original_size(kind: TaskInput, sides: dict[str, Any], image: Path | None, random_hw: tuple[int, int]) -> dict[str, Any]:
    """``sides`` with a detector's ORIGINAL_SIZE where the task takes it and none was given: the image
    file's height and width (so its boxes come back in the file's pixels), or the random images'."""
    import numpy as np

    from blockflow.core.spec import ORIGINAL_SIZE

    if ORIGINAL_SIZE in sides or ORIGINAL_SIZE not in {s.name for s in kind.side_inputs}:
        return sides
    if image is None:
        return {**sides, ORIGINAL_SIZE: np.array(random_hw, dtype=np.int64)}
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(image) as im:
            width, height = im.size
    except (OSError, UnidentifiedImageError) as exc:
        raise click.BadParameter(f"cannot read {image}: {exc}", param_hint="--image") from None
    return {**sides, ORIGINAL_SIZE: np.array([height, width], dtype=np.int64)}


def batched(task: str, kind: TaskInput, sides: dict[str, Any], batch: int) -> dict[str, Any]:
    """The side inputs the task (of input ``kind``) takes, from ``sides``: one sample's array
    repeated over the batch; a name the task does not take, or one it takes missing, is a usage error."""
    import numpy as np

    takes = {s.name: s for s in kind.side_inputs}
    listed = ", ".join(map(str, kind.side_inputs)) or "none"
    if unknown := sorted(sides.keys() - takes.keys()):
        raise click.BadParameter(f"task {task!r} takes no input {unknown[0]!r} (its side inputs: {listed})", param_hint="--input")
    if missing := [n for n in takes if n not in sides]:
        raise click.UsageError(f"task {task!r} takes side input(s) {listed}: give --input {missing[0]}=FILE.npy")
    return {n: np.repeat(a[None], batch, axis=0) if a.shape == takes[n].shape else a for n, a in sides.items()}


def print_outputs(task: str, answer: dict[str, Any], url: str, protocol: str, batch: int, repeat: int, lat: Any,
                  as_json: bool, k: int = 8) -> None:
    """Each output of each sample: its shape and (up to ``k``) first values."""
    import numpy as np
    from rich.markup import escape

    latency = {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "min": float(lat.min())}
    if as_json:
        emit({"task": task, "url": url, "protocol": protocol, "batch": batch, "requests": repeat,
              "outputs": [{name: np.asarray(a[row]).tolist() for name, a in answer.items()} for row in range(batch)],
              "latency_ms": latency})
        return
    for row in range(batch):
        shown = []
        for name, a in answer.items():
            flat = np.asarray(a[row]).ravel()
            shown.append(f"{name} {list(a.shape[1:])} [{', '.join(f'{v:.4g}' for v in flat[:k].tolist())}"
                         f"{', …' if flat.size > k else ''}]")
        out.print(f"[bold]{escape(task)}[/] sample {row}: " + escape("; ".join(shown)), highlight=False)
    out.print(f"latency over {repeat} request(s) ({protocol}, batch {batch}): p50 {latency['p50']:.2f} ms, "
              f"p99 {latency['p99']:.2f} ms, min {latency['min']:.2f} ms")
