"""fp16 and bf16 blocks against the fp32 network, for several families, on one GPU.

In-process (no Triton): each network is cut in three blocks exactly as a plan deploys them
(``blockflow.ensemble_gen.generator.block_spec``: hops cross in the block's precision, CUDA graphs on), a
batch runs through them, and the logits are compared with the whole fp32 network run on the CPU.
Two errors per case: the largest difference relative to the largest logit (what the GPU tests
bound), and the relative L2 norm of the difference. Two more figures per precision separate what
the split costs from what the precision costs:

- ``split_vs_whole``: the three blocks against the same network as one block in the same
  precision on the same GPU (what cutting costs: the hops cross in the block's own dtype, so
  nothing is rounded that the whole network would not round);
- ``input_floor``: the fp32 network on the CPU fed the input rounded to the precision (no
  arithmetic in it at all), a lower bound that no deployment in that precision can beat.

Weights are seeded (``arch.build_network``), so they say how a precision treats the network's
arithmetic, not a trained model's accuracy.

    python -m blockflow.bench.precision --out bench/results/h100/precision-DATE-COMMIT
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.bench.harness import commit as harness_commit
from blockflow.core import arch
from blockflow.ensemble_gen.generator import block_spec
from blockflow.plan import parse_plan

# (torchvision name, input shape, two cuts): the families CI serves, at its sizes, and two at 224×224.
CASES: list[tuple[str, tuple[int, int, int], tuple[str, str]]] = [
    ("resnet50", (3, 224, 224), ("layer2", "layer3")),
    ("mobilenet_v3_small", (3, 32, 32), ("features.5.block.1.2", "features.8")),
    ("efficientnet_b0", (3, 32, 32), ("features.4.0.block.2.fc2", "features.5.2")),
    ("convnext_tiny", (3, 32, 32), ("features.3", "features.5.6.block.2")),
    ("vit_b_16", (3, 32, 32), ("encoder.layers.encoder_layer_3.mlp", "encoder.layers.encoder_layer_8")),
    ("swin_t", (3, 64, 64), ("features.3.1", "features.5.2.norm1")),
    ("densenet121", (3, 32, 32), ("features.denseblock2.denselayer3.conv2", "features.denseblock3.denselayer6.conv1")),
    ("regnet_y_400mf", (3, 32, 32), ("trunk_output.block3.block3-1.f.a.0", "trunk_output.block4.block4-0.f.se.fc2")),
    ("resnext50_32x4d", (3, 32, 32), ("layer2.2.conv1", "layer3.3.bn3")),
    ("vit_b_16", (3, 224, 224), ("encoder.layers.encoder_layer_3", "encoder.layers.encoder_layer_7")),
    ("convnext_tiny", (3, 224, 224), ("features.3", "features.5")),
]
SEED = 5


def _plan(net: str, shape: tuple[int, ...], cuts: tuple[str, str], precision: str, whole: bool = False) -> Any:
    """``net`` cut in three blocks in ``precision``; or, ``whole``, one block of all three stages."""
    blocks: dict[str, Any] = {f"b{i}": {"model": "m", "stages": i, "weights": {"seed": SEED}} for i in range(3)}
    if whole:
        blocks = {"w": {"model": "m", "stages": [0, 2], "weights": {"seed": SEED}}}
    return parse_plan({
        "version": 1, "name": "precision",
        "models": {"m": {"arch": net, "cut_points": list(cuts), "input_shape": list(shape), "num_classes": 1000}},
        "defaults": {"placement": "gpu", "max_batch_size": 8, "precision": precision},
        "blocks": blocks,
        "tasks": {"t": {"path": list(blocks)}},
        "transport": "triton-gpu",
    })


def _rel(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = got.double().cpu() - want
    return float(diff.abs().max() / want.abs().max()), float(diff.norm() / want.norm())


def measure(net: str, shape: tuple[int, ...], cuts: tuple[str, str], batch: int) -> dict[str, Any]:
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(1))
    network = arch.build_network(net, 1000, SEED, shape)
    with torch.inference_mode():
        want = network(x).double()
        floors = {p: _rel(network(x.to(dt).float()), want)[0]
                  for p, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16))}
    row: dict[str, Any] = {"arch": net, "input_shape": list(shape), "cuts": list(cuts), "batch": batch,
                           "logit_max": float(want.abs().max())}
    cuda = torch.device("cuda", 0)
    for precision in ("fp32", "fp16", "bf16"):
        plan = _plan(net, shape, cuts, precision)
        runners = [BlockRunner(block_spec(plan, plan.blocks[f"b{i}"], "triton-gpu"), cuda) for i in range(3)]
        for r in runners:
            r.warmup()
        ys = [x.to(cuda)]
        hops = []
        for r in runners:
            ys = r.run_all(ys)
            hops.append(sorted({str(y.dtype).removeprefix("torch.") for y in ys}))
        got = ys[0].double().cpu()
        whole_plan = _plan(net, shape, cuts, precision, whole=True)
        whole = BlockRunner(block_spec(whole_plan, whole_plan.blocks["w"], "triton-gpu"), cuda)
        whole.warmup()
        max_rel, l2_rel = _rel(got, want)
        row[precision] = {"max_rel": max_rel, "l2_rel": l2_rel, "hop_dtypes": hops[:-1],
                          "split_vs_whole": _rel(got, whole.run_all([x.to(cuda)])[0].double().cpu())[0],
                          "input_floor": floors.get(precision, 0.0)}
        del runners, whole
        torch.cuda.empty_cache()
    return row


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# fp16 and bf16 blocks against the fp32 network — {meta['gpu']}", "",
             f"`python -m blockflow.bench.precision`, commit {meta['commit']}, {meta['date']}; torch {meta['torch']}. "
             "Each network cut in three blocks (CUDA graphs on, hops in the block's precision), batch "
             f"{rows[0]['batch']}, against the whole fp32 network on the CPU. max: the largest difference over the "
             "largest logit; L2: the norm of the difference over the norm of the logits. split/whole: the "
             "three blocks against the same network as one block in the same precision on the GPU (what "
             "cutting costs). floor: the fp32 network fed the input rounded to that precision (what the "
             "precision costs before any arithmetic; no deployment in it does better). Seeded weights.", "",
             "| network | input | hops | fp32 max | fp16 max | fp16 L2 | fp16 split/whole | fp16 floor "
             "| bf16 max | bf16 L2 | bf16 split/whole | bf16 floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hops = " / ".join("+".join(h) for h in r["fp16"]["hop_dtypes"])
        cells = [r["arch"], f"{r['input_shape'][1]}×{r['input_shape'][2]}", f"fp16: {hops}", f"{r['fp32']['max_rel']:.1e}"]
        for p in ("fp16", "bf16"):
            c = r[p]
            cells += [f"{c['max_rel']:.1e}", f"{c['l2_rel']:.1e}", _opt(c.get("split_vs_whole")), _opt(c.get("input_floor"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _opt(v: float | None) -> str:
    return "—" if v is None else f"{v:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--commit", help="the commit measured (default: git's HEAD)")
    ap.add_argument("--cases", default="", help="comma-separated indices into CASES (default: all)")
    ap.add_argument("--merge", type=Path, help="results.json of an earlier run whose rows come first")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = json.loads(args.merge.read_text())["rows"] if args.merge else []
    chosen = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    for net, shape, cuts in chosen:
        rows.append(measure(net, shape, cuts, args.batch))
        print(json.dumps(rows[-1]), flush=True)
    commit = args.commit or harness_commit()
    meta = {"gpu": torch.cuda.get_device_name(0), "commit": commit, "torch": torch.__version__, "host": platform.node(),
            "date": subprocess.run(["date", "-u", "+%Y-%m-%d %H:%M UTC"], capture_output=True, text=True).stdout.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "report.md").write_text(report(rows, meta))
    print(report(rows, meta))


if __name__ == "__main__":
    main()
