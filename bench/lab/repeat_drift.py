"""Whether a model's throughput falls from one perf_analyzer run to the next because of the model or because of
the machine: the same point run back to back in blocks (by default the split, the unsplit model, the split
again) on one server, each run with the host's CPU clock and load and the GPU's SM clock, temperature and power
beside it.

    python -m blockflow.bench.lab.repeat_drift --plan PLAN --out DIR --precision fp16 --mps \\
        --concurrency 256 --client-threads 16 --runs 4 --order tensormq,monolithic-graph,tensormq

``DIR/drift.json`` holds every run; ``DIR/drift.md`` the table, and one row per model and run with what
Triton says each execution spent (input, run, output), its stubs' memory, page faults and context switches per
inference, TensorMQ's pool waits, the GPU's busy share, the hypervisor's steal and the cgroup's throttling. A fall that follows the machine's clocks
comes back in every block; one the model's own state causes starts afresh after the other model's block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from blockflow.bench import host_cpu
from blockflow.bench.harness import commit, device_name, rendered
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.bench.suite import Bench, BenchConfig
from blockflow.bench.triton_stats import delta, model_stats, phases_per_execution, tmq_counters
from blockflow.triton.options import LATENCY_QUANTILES, TRITON_DEFAULT_QUANTILES
from blockflow.triton.process_group import stubs_by_model
from blockflow.triton.server import ServerOptions, TritonServer


def cpu_mhz() -> float | None:
    """The mean current clock of the host's CPUs (cpufreq, else /proc/cpuinfo); None where neither says."""
    freqs = [int(p.read_text()) / 1000 for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq")]
    if not freqs:
        try:
            freqs = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("cpu MHz")]
        except OSError:
            return None
    return statistics.fmean(freqs) if freqs else None


def gpu_state() -> dict[str, float]:
    """GPU 0's SM clock (MHz), temperature (°C), power (W) and busy share since NVML last sampled (%); empty without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {"sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "temp_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                "busy_pct": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)}
    except Exception:  # no GPU, or no NVML: the host's figures alone
        return {}


def per_request(s: dict[str, int]) -> dict[str, float]:
    """One model's Triton statistics over a run: requests, samples per execution, milliseconds per
    request queued and in the model (input, run and output), and each of those phases per execution."""
    n = max(1, s["requests"])
    phases = phases_per_execution(s)
    return {"requests": s["requests"], "samples_per_execution": round(s["inferences"] / max(1, s["executions"]), 2),
            "queue_ms": round(s["queue_ns"] / n / 1e6, 3),
            "compute_ms": round(sum(s[f"{k}_ns"] for k in ("compute_input", "compute_infer", "compute_output")) / n / 1e6, 3),
            **{f"{k}_ms_per_execution": round(phases[f"{k}_ms"], 3) for k in ("compute_input", "compute_infer", "compute_output")}}


def stub_state(server: TritonServer) -> dict[str, dict[str, float]]:
    """Each model's stub processes together: resident MiB, threads, and the counts (minor page faults,
    voluntary and involuntary context switches) so far, to difference between two reads."""
    out: dict[str, dict[str, float]] = {}
    if server.process is None:
        return out
    for model, pids in stubs_by_model(server.process.pid).items():
        m = out.setdefault(model, {"rss_mib": 0.0, "threads": 0.0, "minor_faults": 0.0, "ctx_voluntary": 0.0, "ctx_involuntary": 0.0})
        for pid in pids:
            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    m["rss_mib"] += p.memory_info().rss / 2**20
                    m["threads"] += p.num_threads()
                    m["minor_faults"] += _minor_faults(pid)
                    ctx = p.num_ctx_switches()
                    m["ctx_voluntary"] += ctx.voluntary
                    m["ctx_involuntary"] += ctx.involuntary
            except (psutil.Error, OSError):
                continue
    return out


def _minor_faults(pid: int) -> int:
    """Field 10 of ``/proc/PID/stat`` (minflt), read after the command name, which may hold spaces."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def stub_change(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], inferences: int) -> dict[str, dict[str, float]]:
    """:func:`stub_state` at ``after``, its counts as the change since ``before`` per inference of the run."""
    n = max(1, inferences)
    out = {}
    for model, a in after.items():
        b = before.get(model, {})
        out[model] = {"rss_mib": round(a["rss_mib"], 1), "threads": a["threads"],
                      **{f"{k}_per_inference": round((a[k] - b.get(k, 0.0)) / n, 3) for k in ("minor_faults", "ctx_voluntary", "ctx_involuntary")}}
    return out


def host_waits() -> dict[str, float]:
    """CPU seconds the hypervisor took from this guest (steal) and the CPU cgroup's throttling so far."""
    out = {"steal_s": float(getattr(psutil.cpu_times(), "steal", 0.0))}
    try:
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key in ("nr_throttled", "throttled_usec"):
                out[key] = float(value)
    except (OSError, ValueError):
        pass
    return out


def log_count(server: TritonServer, needle: str) -> int:
    """Lines of the server's log so far that hold ``needle`` (Triton's pinned-memory pool says it is
    "falling back to" ordinary memory when it runs out)."""
    try:
        return sum(1 for line in server.log_path.read_text(errors="replace").splitlines() if needle in line)
    except OSError:
        return 0


def time_wait_sockets() -> int:
    """TCP sockets of this host in TIME-WAIT (state 06 of /proc/net/tcp and tcp6)."""
    n = 0
    for table_file in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            n += sum(1 for line in Path(table_file).read_text().splitlines()[1:] if line.split()[3] == "06")
        except (OSError, IndexError):
            pass
    return n


def stub_shm_mib(server: TritonServer) -> float:
    """The size of the shared memory under /dev/shm that names this server's runtime directory (its stubs' regions)."""
    return round(sum(f.stat().st_size for f in Path("/dev/shm").glob(f"*{server.runtime_dir.name}*") if f.is_file()) / 2**20, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = BenchConfig(args.plan, args.out, seconds=args.seconds, mps=args.mps, precision=args.precision,
                      client_threads=args.client_threads, gpu_alone=False)
    bench = Bench(cfg)
    models = {label: m["model"] for label, m in bench.models(bench.plan).items()}
    order = args.order.split(",")
    unknown = [label for label in order if label not in models]
    if unknown:
        raise SystemExit(f"--order: {', '.join(unknown)} not among this plan's models ({', '.join(models)})")
    server = TritonServer(ServerOptions.on_free_ports([rendered(bench.plan, "blockflow-drift-")], mps=args.mps,
                                                      latency_summaries=args.latency_quantiles is not None,
                                                      latency_quantiles=args.latency_quantiles or LATENCY_QUANTILES,
                                                      extra_args=args.tritonserver_arg))
    server.start(900)
    runs: list[dict[str, Any]] = []
    try:
        for label in models.values():  # warm-up, not recorded
            perf_analyzer(server.http_url, label, bench.shape, 1, 1.0, args.concurrency, None, cfg.input, bench.output_bytes,
                          server.shm_key_file, bench.input_data, args.client_threads)
        t_first = time.monotonic()
        for block, label in enumerate(order):
            if block:
                time.sleep(args.gap_s)  # the server idle between blocks: does a fall come back with time alone?
            for k in range(args.runs):
                start, mhz0, gpu0 = time.monotonic(), cpu_mhz(), gpu_state()
                stats0, cpu0 = model_stats(server.http_url), host_cpu.snapshot(server)
                stubs0, waits0, tmq0 = stub_state(server), host_waits(), tmq_counters(server.metrics_url)
                psutil.cpu_percent(None)
                r = perf_analyzer(server.http_url, models[label], bench.shape, 1, args.seconds, args.concurrency, None, cfg.input,
                                  bench.output_bytes, server.shm_key_file, bench.input_data, args.client_threads)
                busy, mhz1, gpu1 = psutil.cpu_percent(None), cpu_mhz(), gpu_state()
                cpu1, d = host_cpu.snapshot(server), delta(model_stats(server.http_url), stats0)
                inferences = d.get(models[label], {}).get("inferences", 0)
                waits1 = host_waits()
                runs.append({"block": block, "model": label, "run": k, "start_s": round(start - t_first, 1),
                             "seconds": round(time.monotonic() - start, 1), "throughput": r.get("throughput"),
                             "p50_ms": r.get("p50_ms"), "error": r.get("error"), "cpu_busy_pct": busy,
                             "cpu_mhz": [mhz0, mhz1], "gpu_before": gpu0, "gpu_after": gpu1,
                             "host_cpu_ms_per_inference": (host_cpu.per_inference(cpu0, cpu1, inferences)
                                                           if cpu0 is not None and cpu1 is not None and inferences else None),
                             "triton": {m: per_request(s) for m, s in d.items() if s.get("requests", 0) > 0},
                             "tcp_time_wait": time_wait_sockets(), "stub_shm_mib": stub_shm_mib(server),
                             "stubs": stub_change(stubs0, stub_state(server), inferences),
                             "host_waits": {k: round(v - waits0.get(k, 0.0), 3) for k, v in waits1.items()},
                             "tmq": delta(tmq_counters(server.metrics_url), tmq0),
                             "log_falling_back": log_count(server, "falling back")})
                partial = {"meta": {"complete": False}, "runs": runs}  # a call cut short keeps the runs it had
                (args.out / "drift.json").write_text(json.dumps(partial, indent=1))
                print(f"[drift] {label} run {k}: {r.get('throughput')}/s, CPU {busy:.0f}% busy at {mhz1} MHz, GPU {gpu1}", flush=True)
    finally:
        server.stop()
    return {"meta": {"commit": commit(), "device": device_name(), "plan": str(args.plan), "precision": args.precision,
                     "mps": args.mps, "concurrency": args.concurrency, "client_threads": args.client_threads,
                     "seconds": args.seconds, "gap_s": args.gap_s, "complete": True,
                     "latency_summaries": args.latency_quantiles,  # the quantiles kept, or None: off
                     "tritonserver_args": args.tritonserver_arg, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
            "runs": runs}


def table(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"# Throughput run after run: {m['plan']}, c{m['concurrency']}, {m['device']}, commit {m['commit']}, {m['date']}", "",
             "| block | model | run | start s | /s | CPU busy | host CPU ms/inference (its blocks) | Triton queue, compute ms/request "
             "(samples per execution) | TIME-WAIT | stub shm MiB | CPU MHz (before, after) | GPU SM MHz | GPU °C | GPU W |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        g = r["gpu_after"]
        mhz = ", ".join(f"{v:.0f}" if v is not None else "—" for v in r["cpu_mhz"])
        tput = f"{r['throughput']:.0f}" if r["throughput"] is not None else f"failed: {r['error']}"
        watts = f"{g['power_w']:.0f}" if "power_w" in g else "—"
        cpu = r.get("host_cpu_ms_per_inference")
        own = f"{cpu['total']:.3f} ({sum(cpu['blocks'].values()):.3f})" if cpu else "—"
        triton = "; ".join(f"{m} {t['queue_ms']}, {t['compute_ms']} ({t['samples_per_execution']})" for m, t in r.get("triton", {}).items())
        lines.append(f"| {r['block']} | {r['model']} | {r['run']} | {r['start_s']} | {tput} | {r['cpu_busy_pct']:.0f}% | {own} | "
                     f"{triton or '—'} | {r.get('tcp_time_wait', '—')} | {r.get('stub_shm_mib', '—')} | {mhz} | "
                     f"{g.get('sm_mhz', '—')} | {g.get('temp_c', '—')} | {watts} |")
    return "\n".join(lines) + "\n" + detail(res)


def detail(res: dict[str, Any]) -> str:
    """Per run and model: where Triton says its time went per execution, and its stub processes' state."""
    lines = ["", "## Each model in each run", "",
             "| block | run | model | samples/execution | queue ms/request | input, run, output ms/execution | stubs MiB (threads) | "
             "minor faults, voluntary, involuntary switches per inference | pool waits | GPU busy | steal s, throttled | "
             "log \"falling back\" |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        for m, t in r.get("triton", {}).items():
            st = r.get("stubs", {}).get(m)
            stub = f"{st['rss_mib']:.0f} ({st['threads']:.0f})" if st else "—"
            sw = (f"{st['minor_faults_per_inference']}, {st['ctx_voluntary_per_inference']}, {st['ctx_involuntary_per_inference']}"
                  if st else "—")
            hw = r.get("host_waits", {})
            lines.append(f"| {r['block']} | {r['run']} | {m} | {t['samples_per_execution']} | {t['queue_ms']} | "
                         f"{t.get('compute_input_ms_per_execution', '—')}, {t.get('compute_infer_ms_per_execution', '—')}, "
                         f"{t.get('compute_output_ms_per_execution', '—')} | {stub} | {sw} | "
                         f"{r.get('tmq', {}).get(m, {}).get('pool_waits', '—')} | {r['gpu_after'].get('busy_pct', '—')} | "
                         f"{hw.get('steal_s', '—')}, {hw.get('nr_throttled', '—')} | {r.get('log_falling_back', '—')} |")
    return "\n".join(lines) + "\n"


def quantiles(text: str) -> str:
    """``--latency-summaries``' value: quantile:error pairs, each in (0, 1), comma-separated (as Triton takes them)."""
    try:
        pairs = [tuple(float(x) for x in pair.split(":", 1)) for pair in text.split(",")]
        ok = all(len(p) == 2 and all(0 < x < 1 for x in p) for p in pairs)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: quantile:error pairs, each in (0, 1), e.g. {LATENCY_QUANTILES}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--precision", default=None, choices=["fp32", "tf32", "fp16", "bf16"])
    ap.add_argument("--mps", action="store_true")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--client-threads", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=1.5, help="perf_analyzer's measurement window")
    ap.add_argument("--runs", type=int, default=4, help="runs in each block")
    ap.add_argument("--gap-s", type=float, default=0.0, help="seconds the server idles between blocks")
    ap.add_argument("--latency-summaries", dest="latency_quantiles", nargs="?", const=LATENCY_QUANTILES, default=None, type=quantiles,
                    help=f"Triton's latency summaries on, keeping these quantiles (default {LATENCY_QUANTILES}; "
                         f"Triton's own: {TRITON_DEFAULT_QUANTILES}); off without it, as `blockflow serve`")
    ap.add_argument("--tritonserver-arg", action="append", default=[], help="a tritonserver flag, --flag=value (repeatable)")
    ap.add_argument("--order", default="tensormq,monolithic-graph,tensormq", help="the models' labels, one block each")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    (args.out / "drift.json").write_text(json.dumps(res, indent=1))
    (args.out / "drift.md").write_text(table(res))
    print(table(res))


if __name__ == "__main__":
    main()
