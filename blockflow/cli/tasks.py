"""Commands that send requests to tasks: infer, load."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from blockflow.cli import side_inputs, where
from blockflow.cli.app import JSON, app, emit, err, out


@app.command()
@click.argument("task")
@click.option("--image", type=click.Path(path_type=Path), default=None, help="An image file (JPEG/PNG), resized and normalized like ImageNet (for a task that takes uint8 images: "
              "resized, its bytes sent as they are; for one that takes encoded images: the file as it is, decoded by the task).")
@click.option("--random", "random_input", is_flag=True, help="Use a random input (seeded; uint8 noise for a task that takes uint8, "
              "noise encoded as JPEG for one that takes encoded images).")
@click.option("--batch", type=click.IntRange(1, 1024), default=1, show_default=True, help="Batch size.")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
@click.option("--url", default=None, help="host:port (default: $BLOCKFLOW_HTTP_URL or $BLOCKFLOW_GRPC_URL, else the running "
              "server's endpoints file, else 127.0.0.1:8000 for http, :8001 for grpc).")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True, help="Send the request this many times; report latency percentiles.")
@click.option("--input", "sides", multiple=True, metavar="NAME=FILE.npy", callback=lambda _c, _p, v: side_inputs.files(v),
              help="A side input of the task (an input besides the image: `blockflow show` lists them), from a .npy file of "
                   "its dtype, shaped [batch, ...] or one sample's (repeated over the batch). Repeat for each.")
@JSON
def infer(task: str, image: Path | None, random_input: bool, batch: int, protocol: str, url: str | None, repeat: int,
          sides: dict[str, Any], as_json: bool) -> None:
    """Send images to a task; print its top-5 classes (a segmentation task: the classes most of the
    image's pixels take; a detector: its best boxes with labels and scores) and the latency."""
    import numpy as np

    from blockflow.clients.client import TaskClient, top_k
    from blockflow.clients.detections import is_detector
    from blockflow.clients.images import class_names, image_files, load_image, load_image_uint8, random_jpegs
    from blockflow.core.spec import LOGITS

    if (image is None) == (not random_input):
        raise click.UsageError("give exactly one of --image FILE or --random")
    address = where.http(url, protocol)
    with where.reaching(address), TaskClient(address.value, protocol) as client:  # type: ignore[arg-type]
        kind = client.input_of(task)
        shape = kind.shape or client.input_shape(task)
        rh, rw = (224, 224) if kind.encoded else shape[:2] if kind.layout == "HWC" else shape[1:3]  # random_jpegs' size
        sides = side_inputs.with_original_size(kind, sides, image, (int(rh), int(rw)))
        inputs = side_inputs.batched(task, kind, sides, batch)
        rng = np.random.default_rng(0)
        x: np.ndarray[Any, Any]
        if kind.encoded:  # the file's bytes as they are: the task decodes and resizes them
            x = np.repeat(image_files([image]), batch, axis=0) if image is not None else random_jpegs(batch)
        elif image is not None:
            h, w = shape[:2] if kind.layout == "HWC" else shape[1:]
            one = (load_image_uint8(image, h, w, kind.layout) if kind.uint8 else load_image(image, h, w)
                   if kind.layout == "CHW" else load_image(image, h, w).transpose(1, 2, 0))
            x = np.repeat(one[None], batch, axis=0)
        elif kind.uint8:
            x = rng.integers(0, 256, (batch, *shape), dtype=np.uint8)
        else:
            x = rng.standard_normal((batch, *shape), dtype=np.float32)
        latencies = []
        if kind.outputs and LOGITS not in kind.outputs and not is_detector(list(kind.outputs)):  # named outputs
            for _ in range(repeat):
                start = time.perf_counter()
                answer = client.infer_outputs(task, x, inputs=inputs)
                latencies.append((time.perf_counter() - start) * 1e3)
            side_inputs.print_outputs(task, answer, address.value, protocol, batch, repeat, np.array(latencies), as_json)
            return
        if is_detector(list(kind.outputs)):
            for _ in range(repeat):
                start = time.perf_counter()
                found = client.detect(task, x, inputs=inputs)
                latencies.append((time.perf_counter() - start) * 1e3)
            _print_detections(task, found, address.value, protocol, batch, repeat, np.array(latencies), as_json)
            return
        for _ in range(repeat):
            result = client.infer_timed(task, x, inputs=inputs)
            latencies.append(result.latency_ms)
    names = class_names(result.logits.shape[1])
    lat = np.array(latencies)
    if result.logits.ndim == 4:  # a segmentation map: [classes, H, W] logits per image
        _print_segmentation(task, result.logits, address.value, protocol, batch, repeat, lat, as_json)
        return
    if as_json:
        emit({"task": task, "url": address.value, "protocol": protocol, "batch": batch, "requests": repeat,
              "top5": [[{"index": int(i), "class": names[i] if names else str(i), "p": float(p)} for i, p in best]
                       for best in top_k(result.logits, 5)],
              "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "min": float(lat.min())}})
        return
    for row, best in enumerate(top_k(result.logits, 5)):
        out.print(f"[bold]{task}[/] sample {row}: " + ", ".join(f"{names[i] if names else i} ({p:.3f})" for i, p in best))
    out.print(f"latency over {repeat} request(s) ({protocol}, batch {batch}): p50 {np.percentile(lat, 50):.2f} ms, "
              f"p99 {np.percentile(lat, 99):.2f} ms, min {lat.min():.2f} ms")


# Pascal VOC's classes, which torchvision's segmentation weights (COCO_WITH_VOC_LABELS_V1) answer in.
VOC_CLASSES = ("__background__", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor")


def pixel_shares(logits: Any, k: int = 5) -> list[list[tuple[int, float]]]:
    """Per image of ``[batch, classes, H, W]`` logits, the ``k`` classes most pixels take (their
    argmax), with the share of pixels each takes, largest first."""
    import numpy as np

    labels = logits.argmax(axis=1).reshape(logits.shape[0], -1)
    out = []
    for row in labels:
        counts = np.bincount(row, minlength=logits.shape[1])
        best = [int(i) for i in np.argsort(-counts, kind="stable")[:k] if counts[i]]
        out.append([(i, float(counts[i]) / row.size) for i in best])
    return out


def _print_segmentation(task: str, logits: Any, url: str, protocol: str, batch: int, repeat: int, lat: Any,
                        as_json: bool) -> None:
    import numpy as np

    names = VOC_CLASSES if logits.shape[1] == len(VOC_CLASSES) else None
    shares = pixel_shares(logits)
    if as_json:
        emit({"task": task, "url": url, "protocol": protocol, "batch": batch, "requests": repeat,
              "map_shape": list(logits.shape[1:]),
              "classes": [[{"index": i, "class": names[i] if names else str(i), "pixels": s} for i, s in best]
                          for best in shares],
              "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "min": float(lat.min())}})
        return
    _, classes, h, w = logits.shape
    for row, best in enumerate(shares):
        out.print(f"[bold]{task}[/] sample {row}: segmentation {h}×{w}, {classes} classes; by pixel share: "
                  + ", ".join(f"{i} {names[i] if names else ''}".rstrip() + f" ({s:.1%})" for i, s in best))
    out.print(f"latency over {repeat} request(s) ({protocol}, batch {batch}): p50 {np.percentile(lat, 50):.2f} ms, "
              f"p99 {np.percentile(lat, 99):.2f} ms, min {lat.min():.2f} ms")


def _print_detections(task: str, found: list[Any], url: str, protocol: str, batch: int, repeat: int, lat: Any,
                      as_json: bool, k: int = 5) -> None:
    import numpy as np

    if as_json:
        emit({"task": task, "url": url, "protocol": protocol, "batch": batch, "requests": repeat,
              "detections": [{"count": len(d), "best": [{"box": [float(v) for v in d.boxes[i]], "label": int(d.labels[i]),
                                                        "score": float(d.scores[i])} for i in range(min(k, len(d)))]}
                             for d in found],
              "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "min": float(lat.min())}})
        return
    for row, d in enumerate(found):
        best = ", ".join(f"label {int(d.labels[i])} {d.scores[i]:.3f} at "
                         f"[{', '.join(f'{v:.0f}' for v in d.boxes[i])}]" for i in range(min(k, len(d))))
        out.print(f"[bold]{task}[/] sample {row}: {len(d)} detection(s)" + (f"; best: {best}" if best else ""))
    out.print(f"latency over {repeat} request(s) ({protocol}, batch {batch}): p50 {np.percentile(lat, 50):.2f} ms, "
              f"p99 {np.percentile(lat, 99):.2f} ms, min {lat.min():.2f} ms")


@app.command()
@click.option("--task", "tasks", multiple=True, required=True, help="Task to load (repeat for several).")
@click.option("--url", default=None, help="host:port (default: $BLOCKFLOW_HTTP_URL or $BLOCKFLOW_GRPC_URL, else the running "
              "server's endpoints file, else 127.0.0.1:8000 for http, :8001 for grpc).")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
@click.option("--clients", type=click.IntRange(1, 4096), default=1, show_default=True, help="Closed loop: concurrent clients.")
@click.option("--rate", type=click.FloatRange(min=0.001), default=None, help="Open loop: Poisson arrivals per second (instead of --clients).")
@click.option("--batch", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--duration", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Seconds of load.")
@click.option("--max-requests", type=click.IntRange(1), default=None, help="Stop after this many requests.")
@click.option("--out", "csv_path", type=click.Path(path_type=Path), default=None,
              help="CSV of every request (task, batch, send time, latency, outcome).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--input", "input_memory", type=click.Choice(["host", "cuda"]), default="host", show_default=True,
              help="How images reach the server: in the request, or through CUDA shared-memory regions on GPU 0 of this "
                   "machine (one per request in flight; the server must run here and see that GPU). Logits come back in "
                   "the response either way.")
@JSON
def load(tasks: tuple[str, ...], url: str | None, protocol: str, clients: int, rate: float | None, batch: int,
         duration: float, max_requests: int | None, csv_path: Path | None, seed: int, input_memory: str, as_json: bool) -> None:
    """Closed-loop clients or open-loop Poisson arrivals over tasks; per-request latencies and a summary."""
    import asyncio

    if input_memory == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--input cuda needs a CUDA GPU on this machine, and torch sees none; use --input host")

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from blockflow.clients.client import TaskClient
    from blockflow.clients.load import LoadSpec, run_load, summarize, write_csv

    address = where.http(url, protocol)
    url = address.value
    with where.reaching(address), TaskClient(url, protocol) as client:  # type: ignore[arg-type]
        shapes = {t: (kind.shape if (kind := client.input_of(t)).encoded else client.input_shape(t)) for t in tasks}
    if len(set(shapes.values())) > 1:
        raise click.UsageError(f"tasks take different input shapes {shapes}; load them in separate runs")
    spec = LoadSpec(url, tasks, next(iter(shapes.values())), protocol, batch, duration, clients, rate, max_requests, seed,  # type: ignore[arg-type]
                    input_memory)  # type: ignore[arg-type]
    mode = f"open loop, Poisson λ={rate}/s" if rate else f"closed loop, {clients} client(s)"
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} requests"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        tid = bar.add_task(f"{mode} on {', '.join(tasks)}", total=None)
        t0 = time.monotonic()
        records = asyncio.run(run_load(spec, lambda n: bar.advance(tid, n)))
        elapsed = time.monotonic() - t0
    if csv_path is not None:
        write_csv(records, csv_path)
    if as_json:
        emit({"url": url, "protocol": protocol, "input": input_memory, "mode": "open" if rate else "closed", "clients": None if rate else clients,
              "rate": rate, "batch": batch, "seconds": elapsed, "requests": len(records), "csv": str(csv_path) if csv_path else None,
              "tasks": summarize(records, elapsed)})
        return
    table = Table(title=f"{mode}, batch {batch}, {elapsed:.1f} s ({protocol}{', CUDA shared-memory inputs' if input_memory == 'cuda' else ''})")
    for col in ("task", "requests", "errors", "inferences/s", "p50 ms", "p90 ms", "p99 ms", "mean ms"):
        table.add_column(col, justify="right" if col != "task" else "left")
    for name, s in summarize(records, elapsed).items():
        table.add_row(name, f"{s['requests']:.0f}", f"{s['errors']:.0f}", f"{s['throughput']:.1f}", f"{s['p50']:.2f}",
                      f"{s['p90']:.2f}", f"{s['p99']:.2f}", f"{s['mean']:.2f}")
    err.print(f"{len(records)} requests" + (f" (per-request latencies in {csv_path})" if csv_path else ""))
    out.print(table)


