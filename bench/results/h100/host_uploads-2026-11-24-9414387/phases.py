"""Per-model medians of traced execute phases under load: read (entry -> inputs read), queue (inputs
read -> work queued: joins, copies, graph launch, tickets), respond (-> return), the gap between one
execute's return and the next one's entry, and GPU time; over the executes of more than one request.

    python3 phases.py TRACE_DIR     (BLOCKFLOW_TRACE_DIR of the server; see backend/trace.py)
"""

from __future__ import annotations

import statistics
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

from blockflow.bench.timeline import read_traces


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(directory: Path) -> None:
    traces = read_traces(directory)
    print(f"{'model':22s} {'execs':>6s} {'batch':>6s} {'read':>7s} {'queue':>7s} {'respond':>8s} {'execute':>8s} "
          f"{'idle gap':>8s} {'gpu':>7s}  ms (medians, execs with n>1)")
    for model, recs in sorted(traces.items()):
        ex = [r for r in recs if r.get("kind") == "execute" and len(r["t"]) == 4]
        big: list[dict[str, Any]] = [r for r in ex if r["n"] > 1]
        if not big:
            continue

        def phase(i: int, j: int, big: list[dict[str, Any]] = big) -> float:
            return med([(r["t"][j] - r["t"][i]) / 1e6 for r in big])

        gaps = [(b["t"][0] - a["t"][3]) / 1e6 for a, b in pairwise(ex) if b["n"] > 1]
        gpu = med([r["gpu_ms"] for r in big if "gpu_ms" in r])
        print(f"{model:22s} {len(big):6d} {med([r['n'] for r in big]):6.1f} {phase(0, 1):7.3f} {phase(1, 2):7.3f} "
              f"{phase(2, 3):8.3f} {phase(0, 3):8.3f} {med(gaps):8.3f} {gpu:7.3f}")
        laps: dict[str, list[float]] = {}
        for r in big:
            prev = r["t"][1]
            for name, t in r.get("laps", []):
                laps.setdefault(name, []).append((t - prev) / 1e6)
                prev = t
        if laps:
            print("   laps: " + ", ".join(f"{k} {med(v):.3f}" for k, v in laps.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
