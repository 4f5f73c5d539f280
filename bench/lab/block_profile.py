"""Where a server's block processes spend the host's CPU: py-spy samples of every block process, by block.

    python -m blockflow.bench.lab.block_profile record --out DIR [--every 12] [--seconds 3] [--rate 250] &
    python -m blockflow.bench.lab.block_profile summary DIR --windows T1,T2,T3|all [--top 10]

``record`` runs beside a benchmark until stopped (a signal): every ``--every`` seconds it samples
every Triton Python stub process on the machine at once for ``--seconds`` with py-spy
(``record --format raw --nonblocking``: collapsed stacks, the process never paused), one file
``<T>-<pid>.txt`` per process and window ``T`` (the window's start, Unix seconds), and notes which
model each process serves in ``pids.txt``. py-spy is a separate binary: on the GPU machines
``source scripts/gpu_env.sh`` puts the bundle's on ``PATH``; elsewhere ``pip install py-spy``, or
``--py-spy`` names it.

``summary`` adds up the windows named by ``--windows`` (those under the load to look at; the
benchmark's log says when each ran) for each model, all its instances together: the share of its
samples in the stub's own threads (no Python frame: Triton's messages in and out), in ``execute``,
and in the block's other Python threads (TensorMQ's), then its busiest frames. py-spy counts a
thread runnable but waiting for a core as busy, so on a host out of CPU the shares say where the
processes want the cores, not how long each piece takes; a thread read between two frames may show
no Python frame, so the stub's share is an upper bound. A window's failures go to ``errors.txt``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from blockflow.core.procfs import processes
from blockflow.triton.process_group import stub_model

EXECUTE = "TritonPythonModel.execute"


def stub_models() -> dict[int, str]:
    """Each running stub process's model, by pid, whichever server it belongs to."""
    return {pid: model for pid, _ in processes() if (model := stub_model(pid)) is not None}


def record(out: Path, py_spy: str, every: float, seconds: float, rate: int) -> None:
    """Sample every stub process for ``seconds`` each ``every`` seconds, until stopped."""
    out.mkdir(parents=True, exist_ok=True)
    while True:
        t = int(time.time())
        procs: list[tuple[int, subprocess.Popen[bytes]]] = []
        with (out / "pids.txt").open("a") as notes:
            for pid, model in sorted(stub_models().items()):
                notes.write(f"{t} {pid} {model}\n")
                procs.append((pid, subprocess.Popen(
                    [py_spy, "record", "-p", str(pid), "-d", f"{seconds:g}", "-r", str(rate), "-f", "raw", "--nonblocking",
                     "-o", str(out / f"{t}-{pid}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        for pid, p in procs:
            _, err = p.communicate()
            if p.returncode:  # no samples from it this window (no ptrace permission, the process gone): say so
                with (out / "errors.txt").open("a") as errors:
                    errors.write(f"{t} pid {pid}: py-spy exit {p.returncode}: {err.decode(errors='replace').strip()}\n")
        time.sleep(max(0.0, every - (time.time() - t)))


def recorded_windows(out: Path) -> set[str]:
    """Every window ``record`` wrote into ``out`` (start-up and idle ones too)."""
    return {line.split()[0] for line in (out / "pids.txt").read_text().splitlines() if line.strip()}


def summary(out: Path, windows: set[str], top: int) -> str:
    """Per model, over ``windows``: its busy samples by thread kind, and its busiest frames."""
    models = {}
    for line in (out / "pids.txt").read_text().splitlines():
        t, pid, model = line.split()
        models[(t, pid)] = model
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    frames: dict[str, Counter[str]] = defaultdict(Counter)
    for path in sorted(out.glob("*-*.txt")):
        t, pid = path.stem.split("-", 1)
        served = models.get((t, pid))
        if t not in windows or served is None:
            continue
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")  # outermost frame first; none for a thread with no Python frame
            if not count.isdigit():
                continue
            n, python = int(count), [f for f in stack.split(";") if f]
            kind = "stub's own threads" if not python else "execute" if any(f.startswith(EXECUTE + " (") for f in python) else "other Python threads"
            kinds[served][kind] += n
            frames[served][python[-1] if python else "(no Python frame)"] += n
    lines = [f"# Busy samples by model over windows {', '.join(sorted(windows))}", ""]
    for model in sorted(kinds):
        total = sum(kinds[model].values())
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in kinds[model].most_common())
        lines += [f"## {model}: {total} samples", "", shares, ""]
        lines += [f"- {v / total:5.1%} {f}" for f, v in frames[model].most_common(top)] + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample every block process until stopped")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--py-spy", default="py-spy", help="the py-spy binary")
    rec.add_argument("--every", type=float, default=12.0, help="seconds from one window's start to the next's")
    rec.add_argument("--seconds", type=float, default=3.0, help="a window's length")
    rec.add_argument("--rate", type=int, default=250, help="samples a second")
    summ = sub.add_parser("summary", help="the shares of the windows given")
    summ.add_argument("out", type=Path)
    summ.add_argument("--windows", required=True,
                      help="window starts (file name prefixes), comma-separated; 'all' for every window recorded")
    summ.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    if args.command == "record":
        exe = shutil.which(args.py_spy) or (args.py_spy if os.access(args.py_spy, os.X_OK) else None)
        if exe is None:
            sys.exit(f"no py-spy at {args.py_spy!r}: pip install py-spy, or give --py-spy PATH")
        record(args.out, exe, args.every, args.seconds, args.rate)
    else:
        print(summary(args.out, recorded_windows(args.out) if args.windows == "all" else set(args.windows.split(",")), args.top))


if __name__ == "__main__":
    main()
