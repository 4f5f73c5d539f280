"""``report.md`` and PNG plots from a benchmark's ``results.json``.

    python -m blockflow.bench.report bench/results/h100      # redraw from results.json

Each plot is named after the thesis figure it reproduces (fig4_3_pipeline.png, …).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from blockflow.bench.failures import failures_section
from blockflow.bench.host_cpu import busiest_threads

ORDER = ["monolithic-eager", "monolithic-graph", "tensormq", "triton-gpu", "triton-cpu"]


def _host_cpu_cell(cpu: dict[str, Any] | None) -> str:
    if cpu is None:
        return "—"
    others = sum(cpu["blocks"].values()) - cpu["own_blocks"]
    return (f"{cpu['total']:.3f} (Triton {cpu['server']:.3f}, its blocks {cpu['own_blocks']:.3f}, other models' "
            f"{others:.3f}, front door {cpu['front_door']:.3f}, client {cpu['client']:.3f})")


def _labels(d: dict[str, Any]) -> list[str]:
    return sorted(d, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))


def _f(v: Any, fmt: str = ".2f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def spread_text(r: dict[str, Any], key: str) -> str:
    """" ±N%": half the range of a figure's repeated runs, as a share of it; "" after a single run."""
    spread = r.get("spread", {}).get(key)
    return f" ±{spread * 50:.0f}%" if spread is not None and len(r.get("runs", [])) > 1 else ""


def _cell(r: dict[str, Any], key: str, fmt: str = ".2f") -> str:
    """A figure, with ± half the range of its repeated runs when there were several."""
    if "error" in r:
        return "failed"
    return _f(r.get(key), fmt) + spread_text(r, key)


def split_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each transport against the monolithic reference (CUDA graphs if measured, else eager), in
    the same run: c1 p50 ratio, per-hop cost and throughput ratio at the highest concurrency."""
    pipe, conc = res.get("pipeline", {}), res.get("concurrency", {})
    mono = next((m for m in ("monolithic-graph", "monolithic-eager") if m in pipe), None)
    if mono is None:
        return []
    hops = max(1, len(res.get("path", [])) - 1)
    rows = []
    for label in _labels(pipe):
        if label.startswith("monolithic") or "error" in pipe[label] or "error" in pipe[mono]:
            continue
        m, s = pipe[mono]["p50_ms"], pipe[label]["p50_ms"]
        row: dict[str, Any] = {"transport": label, "mono": mono, "mono_p50_ms": m, "split_p50_ms": s,
                               "p50_ratio": s / m, "hop_ms": (s - m) / hops}
        top = max(conc.get(label, {}), key=int, default=None)
        if top is not None and top in conc.get(mono, {}) and "error" not in conc[label][top] and "error" not in conc[mono][top]:
            row.update(concurrency=int(top), mono_throughput=conc[mono][top]["throughput"],
                       split_throughput=conc[label][top]["throughput"],
                       throughput_ratio=conc[label][top]["throughput"] / conc[mono][top]["throughput"])
        rows.append(row)
    return rows


def gpu_alone(res: dict[str, Any]) -> dict[str, Any] | None:
    """The figures of the task's whole network in a plain process (``meta.gpu_alone``), if measured."""
    figures: dict[str, Any] | None = res.get("meta", {}).get("gpu_alone")
    return figures


def alone_b32(res: dict[str, Any]) -> float | None:
    """The GPU alone's images/s at batch 32 that served figures are shared against: with its JPEGs
    decoded for a task that takes files (``images_per_s_decoded``), else the network's alone."""
    figures = gpu_alone(res) or {}
    b32: float | None = figures.get("images_per_s_decoded", figures.get("images_per_s", {})).get("32")
    return b32


def _share(r: dict[str, Any], images_per_s: float | None) -> str:
    """" (N%)": a served throughput as a share of the GPU alone's; "" where either is missing."""
    if not images_per_s or "error" in r or r.get("throughput") is None:
        return ""
    return f" ({100 * r['throughput'] / images_per_s:.0f}%)"


def _latency_ratio(r: dict[str, Any] | None, batch1_ms: float) -> str:
    """A served p50 at concurrency 1 against the GPU alone's batch 1, "N×"; "—" where it was not measured."""
    if r is None or "error" in r or r.get("p50_ms") is None:
        return "—"
    return f"{r['p50_ms'] / batch1_ms:.1f}×"


def gpu_alone_section(res: dict[str, Any]) -> list[str]:
    """"The GPU alone": its figures, or why there are none; nothing for results that predate it."""
    meta = res.get("meta", {})
    if "gpu_alone" not in meta:
        return []
    figures = meta["gpu_alone"]
    L = ["## The GPU alone: the task's whole network in a plain process", ""]
    if figures is None:
        return [*L, f"Not measured: {meta.get('gpu_alone_reason', 'no reason recorded')}.", ""]
    ips = figures.get("images_per_s", {})
    sizes = sorted(ips, key=int)
    replays = figures.get("replays", {})
    L += [f"Before the server started, in a process of its own: the task's network unsplit, built as a block builds it "
          f"({figures.get('precision', '?')}, {figures.get('memory_format', '?')}, one CUDA graph per batch size) on "
          f"{figures.get('device', '?')}; the median of {', '.join(f'{n} (b{b})' for b, n in replays.items()) or 'several'} "
          "graph replays timed with CUDA events. No server, no transport, no client: what the GPU gives at most. The "
          "concurrency table gives each served throughput as a share of batch 32's, and c1 p50 against batch 1.", "",
          "| batch 1 ms | " + " | ".join(f"batch {b} images/s" for b in sizes) + " |", "|---|" + "---|" * len(sizes),
          f"| {_f(figures.get('batch1_ms'), '.3f')} | " + " | ".join(f"{ips[b]:,.0f}" for b in sizes) + " |", ""]
    if decoded := figures.get("images_per_s_decoded"):
        L += ["The task takes JPEG/PNG files: with a batch of the sample JPEGs decoded first as the block decodes them "
              "(host clock), " + ", ".join(f"batch {b} {v:,.0f} images/s ({figures['decode_ms'][b]:.2f} ms decoding)"
                                          for b, v in sorted(decoded.items(), key=lambda kv: int(kv[0])))
              + "; served shares are of these.", ""]
    if figures.get("skipped"):
        L += ["Not measured: " + "; ".join(f"batch {b} ({why})" for b, why in figures["skipped"].items()) + ".", ""]
    return L


def plots(res: dict[str, Any], out: Path) -> list[str]:
    """Draw every figure the results allow; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    device = res["meta"]["device"]
    pipe = res.get("pipeline", {})
    if pipe:  # Fig. 4.3: pipeline time per transport
        labels = _labels(pipe)
        fig, ax = plt.subplots(figsize=(7, 4))
        p50 = [pipe[k].get("p50_ms", 0) for k in labels]
        p99 = [pipe[k].get("p99_ms", 0) for k in labels]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
        ax.set_xticks(list(x), labels, rotation=15)
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"Fig 4.3 — {res['task']} end to end, batch 1 ({device})")
        ax.legend()
        save(fig, "fig4_3_pipeline.png")
        # Fig. 4.4: per-block compute vs overhead
        ens = [k for k in labels if "blocks" in pipe[k]]
        if ens:
            fig, ax = plt.subplots(figsize=(7, 4))
            for i, k in enumerate(ens):
                bottom = 0.0
                for j, b in enumerate(pipe[k]["blocks"]):
                    ax.bar(i, b["compute_ms"], bottom=bottom, color=f"C{j}", label=f"block {j} compute" if i == 0 else None)
                    bottom += b["compute_ms"]
                ax.bar(i, max(0.0, pipe[k].get("avg_ms", bottom) - bottom), bottom=bottom, color="lightgray",
                       hatch="//", label="overhead (transport, ensemble, HTTP)" if i == 0 else None)
            ax.set_xticks(range(len(ens)), ens)
            ax.set_ylabel("mean latency (ms)")
            ax.set_title(f"Fig 4.4 — compute per block vs overhead, batch 1 ({device})")
            ax.legend(fontsize=8)
            save(fig, "fig4_4_breakdown.png")
    if res.get("batch"):  # Fig. 4.7: batch scaling
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for k in _labels(res["batch"]):
            rows = res["batch"][k]
            bs = sorted(rows, key=int)
            ok = [b for b in bs if "error" not in rows[b]]
            a1.plot([int(b) for b in ok], [rows[b]["p50_ms"] for b in ok], marker="o", label=k)
            a2.plot([int(b) for b in ok], [rows[b]["throughput"] for b in ok], marker="o", label=k)
        a1.set(xlabel="batch size", ylabel="p50 latency (ms)", title="Fig 4.7 — latency vs batch")
        a2.set(xlabel="batch size", ylabel="inferences/s", title="throughput vs batch")
        a1.legend(fontsize=8)
        save(fig, "fig4_7_batch.png")
    conc = res.get("concurrency", {})
    if conc:  # Fig. 4.11: latency under many clients (perf_analyzer concurrency) and Fig. 4.10: energy
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for k in _labels(conc):
            rows = conc[k]
            cs = [c for c in sorted(rows, key=int) if "error" not in rows[c]]
            a1.plot([int(c) for c in cs], [rows[c]["p99_ms"] for c in cs], marker="o", label=k)
            a2.plot([int(c) for c in cs], [rows[c]["throughput"] for c in cs], marker="o", label=k)
        a1.set(xlabel="concurrent requests", ylabel="p99 latency (ms)", title="Fig 4.11 — latency vs clients", xscale="log")
        a2.set(xlabel="concurrent requests", ylabel="inferences/s", title="throughput vs clients", xscale="log")
        a1.legend(fontsize=8)
        save(fig, "fig4_11_clients.png")
        energy = {k: {c: r["energy_mj_per_inference"] for c, r in conc[k].items() if "energy_mj_per_inference" in r} for k in conc}
        if any(energy.values()):
            fig, ax = plt.subplots(figsize=(7, 4))
            for k in _labels(energy):
                cs = sorted(energy[k], key=int)
                ax.plot([int(c) for c in cs], [energy[k][c] for c in cs], marker="o", label=k)
            ax.set(xlabel="concurrent requests", ylabel="energy per inference (mJ, all GPUs)", xscale="log",
                   title=f"Fig 4.10 — energy per inference ({device})")
            ax.legend(fontsize=8)
            save(fig, "fig4_10_energy.png")
    rate = {k: v for k, v in res.get("rate", {}).items() if isinstance(v, dict)}
    if rate:  # Fig. 4.12: throughput and latency vs offered load
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for k in _labels(rate):
            rows = [r for r in rate[k].values() if "error" not in r]
            rows.sort(key=lambda r: r["offered_per_s"])
            a1.plot([r["offered_per_s"] for r in rows], [r["throughput"] for r in rows], marker="o", label=k)
            a2.plot([r["offered_per_s"] for r in rows], [r["p99_ms"] for r in rows], marker="o", label=k)
        a1.set(xlabel="offered load (Poisson, req/s)", ylabel="served inferences/s", title="Fig 4.12 — throughput vs offered load")
        a2.set(xlabel="offered load (Poisson, req/s)", ylabel="p99 latency (ms)", title="p99 vs offered load", yscale="log")
        a1.legend(fontsize=8)
        save(fig, "fig4_12_offered_load.png")
    gpus = {k: v for k, v in res.get("gpus", {}).items() if k.isdigit()}
    if gpus:  # Fig. 4.15-4.16: blocks on 1, 2, 4 GPUs
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for label in ("tensormq", "triton-gpu"):
            ks = [k for k in sorted(gpus, key=int) if label in gpus[k]]
            if not ks:
                continue
            c1 = [gpus[k][label].get("1", {}).get("p50_ms") for k in ks]
            cmax = [max((r.get("throughput", 0) for c, r in gpus[k][label].items()), default=0) for k in ks]
            a1.plot([int(k) for k in ks], c1, marker="o", label=label)
            a2.plot([int(k) for k in ks], cmax, marker="o", label=label)
        a1.set(xlabel="GPUs the blocks are spread over", ylabel="p50 latency, batch 1 (ms)", title="Fig 4.15 — latency vs GPUs")
        a2.set(xlabel="GPUs the blocks are spread over", ylabel="inferences/s (highest concurrency)", title="Fig 4.16 — throughput vs GPUs")
        for ax in (a1, a2):  # whole GPUs only: no 1.2, 1.4, ... ticks between them
            ax.set_xticks(sorted(int(k) for k in gpus))
        a1.legend(fontsize=8)
        save(fig, "fig4_15_16_gpus.png")
    return made


def named_switches(meta: dict[str, Any]) -> str:
    """The behaviour switches a run recorded (``switches``: ``bench.harness.switches``), as a report's header names them."""
    return "".join(f"`{k}={v}`; " for k, v in meta.get("switches", {}).items())


def write_report(res: dict[str, Any], out: Path) -> None:
    meta = res["meta"]
    warm = f"{meta['warm_cores_ms']:g} ms" if meta.get("warm_cores_ms") else "off"  # blockflow.triton.warm_cores
    L: list[str] = [f"# BlockFlow benchmark — {meta['device']}", "",
                    f"Plan `{meta['plan']}` ({meta['plan_name']}), task `{res['task']}` = {' → '.join(res['path'])}; "
                    f"{meta['date']} on {meta['host']}; GPUs: {', '.join(meta['gpus']) or 'none'}; torch {meta['torch']}"
                    + ("; **--quick**" if meta.get("quick") else "") + ".", "",
                    f"Commit {meta.get('commit', '?')}; blocks and monolithic references in **{meta.get('precision', 'fp32')}** "
                    f"(references: {meta.get('reference_precision', 'fp32')}); client inputs: **{meta.get('input', 'host')}**"
                    f"{' (perf_analyzer --shared-memory cuda: outputs too, which the server copies into the client region in its own CUDA context)' if meta.get('input') == 'cuda-shm' else ' memory, in the request'}; "
                    f"MPS {'on' if meta.get('mps') else 'off'}; warm cores {warm}; "
                    + named_switches(meta)
                    + f"each figure the median of {meta.get('repeats', 1)} perf_analyzer "
                    "run(s)" + (" ± half their range" if meta.get("repeats", 1) > 1 else "") + ".", "",
                    "Every row was measured in one server, one after the other (compare within this report only). "
                    "Latencies are perf_analyzer's (HTTP, binary tensors) unless noted.", ""]
    if not meta.get("complete", True):  # results.json of a run cut short (results files before this flag are complete)
        L += ["**Incomplete run**: it stopped before its end; the sections below are those it finished.", ""]
    L += gpu_alone_section(res)
    split = split_rows(res)
    if split:
        L += [f"## The split against the unsplit model ({split[0]['mono']}, same precision, same run)", "",
              "hop: (split − mono) p50 at c1 over the task's hops; throughput at the highest concurrency measured.", "",
              "| transport | mono c1 p50 ms | split c1 p50 ms | split/mono | hop ms | mono /s | split /s | split/mono |",
              "|---|---|---|---|---|---|---|---|"]
        for r in split:
            L.append(f"| {r['transport']} | {r['mono_p50_ms']:.2f} | {r['split_p50_ms']:.2f} | {r['p50_ratio']:.2f}× | {r['hop_ms']:.3f} | "
                     + (f"{r['mono_throughput']:.0f} (c{r['concurrency']}) | {r['split_throughput']:.0f} | {r['throughput_ratio']:.2f}× |"
                        if "throughput_ratio" in r else "— | — | — |"))
        L.append("")
    pipe = res.get("pipeline", {})
    if pipe:
        L += ["## Pipeline time (Fig 4.3) and where it goes (Fig 4.4), batch 1, concurrency 1", "",
              "| model | p50 ms | p99 ms | mean ms | block compute ms | overhead ms | overhead per block ms |", "|---|---|---|---|---|---|---|"]
        for k in _labels(pipe):
            r = pipe[k]
            comp = r.get("block_compute_ms", r.get("server_compute_ms"))
            n = max(1, len(r.get("blocks", [])))
            over = r["avg_ms"] - comp if "avg_ms" in r and comp is not None else None
            L.append(f"| {k} | {_cell(r, 'p50_ms')} | {_cell(r, 'p99_ms')} | {_cell(r, 'avg_ms')} | {_f(comp)} | {_f(over)} | "
                     f"{_f(over / n if over is not None and 'blocks' in r else None)} |")
        L += ["", "Block compute is Triton's compute time of each composing model (for `tensormq` it excludes GPU work "
              "still queued when `execute` returns, which the next block waits for on the GPU).", ""]
    if res.get("batch"):
        bs = sorted({b for rows in res["batch"].values() for b in rows}, key=int)
        L += ["## Batch scaling (Fig 4.7), concurrency 1: p50 ms / inferences per s", "",
              "| model | " + " | ".join(f"b{b}" for b in bs) + " |", "|---|" + "---|" * len(bs)]
        for k in _labels(res["batch"]):
            rows = res["batch"][k]
            L.append(f"| {k} | " + " | ".join(f"{_cell(rows[b], 'p50_ms')} / {_cell(rows[b], 'throughput', '.0f')}" if b in rows else "—" for b in bs) + " |")
        L.append("")
    conc = res.get("concurrency", {})
    if conc:
        cs = sorted({c for rows in conc.values() for c in rows}, key=int)
        alone = gpu_alone(res)
        b32 = alone_b32(res)
        b1 = (alone or {}).get("batch1_ms")
        L += ["## Concurrency (Fig 4.11), batch 1: p50 / p99 ms, inferences per s"
              + (" (% of the GPU alone at batch 32)" if b32 else ""), "",
              "| model | " + " | ".join(f"c{c}" for c in cs) + " |" + (" c1 p50 / GPU alone b1 |" if b1 else ""),
              "|---|" + "---|" * (len(cs) + bool(b1))]
        for k in _labels(conc):
            rows = conc[k]
            L.append(f"| {k} | " + " | ".join(f"{_cell(rows[c], 'p50_ms')} / {_cell(rows[c], 'p99_ms')}, {_cell(rows[c], 'throughput', '.0f')}/s"
                                              + _share(rows[c], b32) if c in rows else "—" for c in cs) + " |"
                     + (f" {_latency_ratio(rows.get('1'), b1)} |" if b1 else ""))
        L.append("")
        if any("energy_mj_per_inference" in r for rows in conc.values() for r in rows.values()):
            L += ["## Energy per inference (Fig 4.10), GPU utilisation and power (NVML, all GPUs)", "",
                  "| model | " + " | ".join(f"c{c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
            for k in _labels(conc):
                rows = conc[k]
                cells = []
                for c in cs:
                    r = rows.get(c, {})
                    util = r.get("util_pct", [None])
                    power = r.get("power_w", [None])
                    cells.append(f"{_f(r.get('energy_mj_per_inference'), '.1f')} mJ, {_f(max(util) if util and util[0] is not None else None, '.0f')}% util, "
                                 f"{_f(sum(power) if power and power[0] is not None else None, '.0f')} W")
                L.append(f"| {k} | " + " | ".join(cells) + " |")
            L.append("")
        if any("host_cpu_ms_per_inference" in r for rows in conc.values() for r in rows.values()):
            L += ["## Host CPU per inference: ms of CPU time of Triton's threads, the model's block processes, "
                  "the other models' (idle meanwhile), the front door and the client (`bench/host_cpu.py`)", "",
                  "| model | " + " | ".join(f"c{c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
            for k in _labels(conc):
                L.append(f"| {k} | " + " | ".join(_host_cpu_cell(conc[k].get(c, {}).get("host_cpu_ms_per_inference")) for c in cs) + " |")
            L += ["", f"Busiest threads at c{cs[-1]} (process, thread, ms per inference; `main` runs a block's `execute`): "
                  + " · ".join(f"{k}: {busiest_threads(conc[k].get(cs[-1], {}).get('host_cpu_ms_per_inference'))}" for k in _labels(conc)), ""]
    rate = {k: v for k, v in res.get("rate", {}).items() if isinstance(v, dict)}
    if rate:
        L += [f"## Offered load (Fig 4.12): Poisson arrivals at fractions of {res['rate']['peak_per_s']:.0f} req/s "
              "(the best concurrency-sweep throughput); served inferences/s and p99 ms", "",
              "| model | " + " | ".join(f"{f}×" for f in next(iter(rate.values()))) + " |", "|---|" + "---|" * len(next(iter(rate.values())))]
        for k in _labels(rate):
            L.append(f"| {k} | " + " | ".join(f"{_cell(r, 'throughput', '.0f')}/s, p99 {_cell(r, 'p99_ms')}" for r in rate[k].values()) + " |")
        L.append("")
    if res.get("clients"):
        ns = sorted({n for rows in res["clients"].values() for n in rows}, key=int)
        L += ["## `blockflow load` closed-loop clients (thesis' task generator, §4.2): p50 / p99 ms, inferences per s, errors", "",
              "| model | " + " | ".join(f"{n} clients" for n in ns) + " |", "|---|" + "---|" * len(ns)]
        for k in _labels(res["clients"]):
            rows = res["clients"][k]
            L.append(f"| {k} | " + " | ".join(f"{_f(rows[n]['p50_ms'])} / {_f(rows[n]['p99_ms'])}, {_f(rows[n]['throughput'], '.0f')}/s, {int(rows[n]['errors'])} err"
                                              if n in rows else "—" for n in ns) + " |")
        L.append("")
    mem = res.get("memory", {})
    if mem.get("models"):
        L += ["## Memory per model (processes, RSS, GPU memory from NVML)", "",
              f"GPU memory used on each GPU after start-up: {', '.join(f'{m:.0f} MiB' for m in mem['gpu_used_mib']) or 'no GPU'}.", "",
              "| model | processes | RSS MiB | GPU MiB |", "|---|---|---|---|"]
        for m, r in mem["models"].items():
            L.append(f"| {m} | {r['processes']} | {r['rss_mib']:.0f} | {_f(r['gpu_mib'], '.0f')} |")
        L.append("")
    gpus = res.get("gpus", {})
    if any(k.isdigit() for k in gpus):
        L += ["## Blocks spread over GPUs (Fig 4.15–4.16): p50 ms at c1; inferences/s at the highest concurrency", "",
              "| GPUs | " + " | ".join(("tensormq", "triton-gpu")) + " |", "|---|---|---|"]
        for k in sorted((k for k in gpus if k.isdigit()), key=int):
            cells = []
            for label in ("tensormq", "triton-gpu"):
                rows = gpus[k].get(label, {})
                top = max(rows, key=int) if rows else None
                cells.append(f"{_cell(rows.get('1', {}), 'p50_ms')} ms, {_cell(rows[top], 'throughput', '.0f')}/s" if top else "—")
            L.append(f"| {k} | " + " | ".join(cells) + " |")
        L.append("")
    elif gpus:
        L += [f"Blocks over several GPUs (Fig 4.15–4.16): skipped ({gpus.get('skipped')}).", ""]
    L += failures_section(res)
    try:
        names = plots(res, out)
    except ImportError:
        names = []
        L += ["(matplotlib is not installed here: draw the plots with `python -m blockflow.bench.report DIR` where it is.)", ""]
    if names:
        L += ["## Plots", ""] + [f"![{n}]({n})" for n in names] + [""]
    (out / "report.md").write_text("\n".join(L))


def main() -> None:
    ap = argparse.ArgumentParser(description="Write DIR/report.md (and its plots, where matplotlib is installed) "
                                             "from DIR/results.json, as blockflow bench does.")
    ap.add_argument("dir", nargs="?", type=Path, default=Path("."), metavar="DIR", help="a results directory (default: .)")
    out = ap.parse_args().dir
    if not (out / "results.json").is_file():
        ap.error(f"{out / 'results.json'} does not exist: DIR is a directory blockflow bench wrote")
    write_report(json.loads((out / "results.json").read_text()), out)
    print(f"wrote {out / 'report.md'}")


if __name__ == "__main__":
    main()
