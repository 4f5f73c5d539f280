"""What a hop could cost if blocks handed each other their output directly, the ensemble only fanning out.

Today a task's ensemble is a chain: each block's step is scheduled when the previous block has
answered, and each such ensemble step is a chain of thread and process wake-ups in Triton
(``python -m blockflow.bench.lab.ensemble_floor``). This bench measures, with Python-backend models
that do no work beyond moving 256 bytes, what a *relay* would cost instead: the ensemble's first
step mints a key (16 random bytes, made in the server, so a client cannot choose one), and every
later step takes that step's output, so Triton schedules them all at once; each model then waits
on a ZeroMQ ``PULL`` socket for its predecessor's output under that key and pushes its own to its
successor. Three ensembles of four steps, all in one server, measured in turns:

- ``chain``: four copy models in a chain (what a 4-block task is now);
- ``relay``: the first step fans out to the three others, which hand over by ZeroMQ. Triton
  requires every step to have an output and every ensemble tensor to be used, so the two middle
  steps' 16-byte outputs are extra outputs of the ensemble. A client that asks for ``OUT`` alone
  cannot use it: the ensemble then skips the steps whose outputs nobody asked for
  (``EnsembleContext``'s pruning, ``ensemble_scheduler.cc``), and the last step waits in vain.
  It is measured asking for every output (perf_analyzer's default), as the bound of the idea;
- ``relay_join``: no extra outputs: the first step fans out to the second and third, the third
  waits for the second over ZeroMQ, and the last step takes both of their outputs through the
  ensemble (two ensemble steps and one direct hand-over on the request's path);
- ``relay_early``: as ``relay_join``, but the two middle steps answer with the key as soon as they
  have it (through the response sender), then move the payload: the last step is scheduled after
  those two answers and waits over ZeroMQ for the third step's hand-over, which travels meanwhile.

Every ensemble gives back its input, checked byte for byte with many concurrent clients sending
distinct inputs before anything is timed. perf_analyzer (HTTP, batch 1) measures each at
concurrency 1 and 32; a one-step ensemble of the copy model gives the ensemble's own entry and exit,
so a hop is ``(p50(4 steps) - p50(1 step)) / 3``.

    python -m blockflow.bench.lab.relay_floor --out DIR [--seconds 1 --repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from blockflow.bench.harness import commit, device_name, write_results
from blockflow.bench.lab.ensemble_floor import TICKET, _chain_config, _copy_config, copy_model
from blockflow.bench.perf_analyzer import median_of, perf_analyzer
from blockflow.bench.report import spread_text
from blockflow.bench.triton_stats import model_stats
from blockflow.triton.server import ServerOptions, TritonServer

KEY = 16
# The stub's interpreter does not reliably honour PYTHONPATH (see ensemble_gen.generator.MODEL_PY): pyzmq
# is found through the same BLOCKFLOW_PYTHONPATH roots as a block's runtime.
RELAY_MODEL = '''import json
import os
import sys
import time

for _root in reversed(os.environ.get("BLOCKFLOW_PYTHONPATH", "").split(os.pathsep)):
    if _root and _root not in sys.path:
        sys.path.insert(0, _root)

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
import zmq
from torch.utils.dlpack import from_dlpack, to_dlpack

WAIT_S = 5.0
KEY = __KEY__


def _response(name, y):
    return pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(name, to_dlpack(torch.from_numpy(np.ascontiguousarray(y).copy())))])


class TritonPythonModel:
    """ROLE head: IN -> X (a fresh key, then IN). Other roles take X; WAIT: their payload comes from
    their predecessor over ZeroMQ under X's key, else from X itself; PUSH_TO: the model that gets
    their payload next; OUTPUT: KEY (X's key) or OUT (the payload); EARLY: answer with the key at once,
    through the response sender, then move the payload (an error can then only show downstream)."""

    def initialize(self, args):
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.role, self.wait, self.output = p.get("ROLE", ""), p.get("WAIT") == "yes", p.get("OUTPUT", "KEY")
        self.early = p.get("EARLY") == "yes"
        self.ctx = zmq.Context()
        self.pull = self.push = None
        if self.wait:
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.bind(f"ipc://{p['RELAY_DIR']}/{args['model_name']}.sock")
        if p.get("PUSH_TO"):
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 0)
            self.push.connect(f"ipc://{p['RELAY_DIR']}/{p['PUSH_TO']}.sock")
        self.pending = {}

    def _take(self, key, deadline):
        # The execute thread itself waits on the socket: one wake-up when the hand-over comes.
        while key not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pull.poll(max(1, int(left * 1000))):
                raise TimeoutError(f"no hand-over for key {key.hex()} within {WAIT_S} s")
            k, v = self.pull.recv_multipart(copy=True)
            self.pending[k] = v
        return self.pending.pop(key)

    def execute(self, requests):
        xs = [from_dlpack(pb_utils.get_input_tensor_by_name(r, "IN" if self.role == "head" else "X").to_dlpack()).numpy()
              for r in requests]
        if self.early:  # answer with the keys first: the ensemble goes on while the payload moves
            for r, x in zip(requests, xs):
                r.get_response_sender().send(_response("KEY", x[:, :KEY]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        out = []
        deadline = time.monotonic() + WAIT_S
        for x in xs:
            try:
                if self.role == "head":
                    keys = np.frombuffer(os.urandom(KEY * x.shape[0]), dtype=np.uint8).reshape(x.shape[0], KEY)
                    name, y = "X", np.concatenate([keys, x], axis=1)
                else:
                    rows = []
                    for row in x:
                        key = row[:KEY].tobytes()
                        payload = self._take(key, deadline) if self.wait else row[KEY:].tobytes()
                        if self.push is not None:
                            self.push.send_multipart([key, payload], copy=False)
                        rows.append(row[:KEY] if self.output == "KEY" else np.frombuffer(payload, dtype=np.uint8))
                    name, y = self.output, np.stack(rows)
                out.append(None if self.early else _response(name, y))
            except TimeoutError as exc:
                out.append(None if self.early else pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return out

    def finalize(self):
        self.ctx.destroy(linger=0)
'''.replace("__KEY__", str(KEY))
JOIN_MODEL = '''import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    """KEY (only waited for) and IN -> OUT, a copy of IN."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
                    "OUT", to_dlpack(from_dlpack(pb_utils.get_input_tensor_by_name(r, "IN").to_dlpack()).clone()))])
                for r in requests]
'''
ENSEMBLES = ("chain1", "chain4", "relay", "relay_join", "relay_early")


def _model(name: str, inputs: dict[str, int], outputs: dict[str, int], params: dict[str, str]) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=32)
    for n, d in inputs.items():
        cfg.input.add(name=n, data_type=mc.TYPE_UINT8, dims=[d])
    for n, d in outputs.items():
        cfg.output.add(name=n, data_type=mc.TYPE_UINT8, dims=[d])
    cfg.instance_group.add(count=1)
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    cfg.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value = "yes"
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    return cfg


def _ensemble(name: str, steps: list[tuple[str, dict[str, str], dict[str, str]]], outputs: dict[str, int]) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=32)
    cfg.input.add(name="IN", data_type=mc.TYPE_UINT8, dims=[TICKET])
    for n, d in outputs.items():
        cfg.output.add(name=n, data_type=mc.TYPE_UINT8, dims=[d])
    for model, inputs, outs in steps:
        step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        step.input_map.update(inputs)
        step.output_map.update(outs)
    return cfg


def configs(relay_dir: Path, laps_dir: Path) -> list[tuple[mc.ModelConfig, str]]:
    """Every model of the bench's ensembles (``ENSEMBLES``), with its source (``""`` for an ensemble)."""
    x, key, out = {"X": KEY + TICKET}, {"KEY": KEY}, {"OUT": TICKET}
    d = {"RELAY_DIR": str(relay_dir)}
    copies = [f"copy_{i}" for i in range(4)]
    models: list[tuple[mc.ModelConfig, str]] = [(_copy_config(n, True, laps_dir), copy_model()) for n in copies]
    models += [(_chain_config("chain1", copies[:1]), ""), (_chain_config("chain4", copies), "")]
    # relay: head -> {r1, r2, r3}; r1 -> r2 -> r3 over ZeroMQ.
    models += [(_model("head_r", {"IN": TICKET}, x, {"ROLE": "head"}), RELAY_MODEL),
               (_model("r1", x, key, {**d, "PUSH_TO": "r2"}), RELAY_MODEL),
               (_model("r2", x, key, {**d, "WAIT": "yes", "PUSH_TO": "r3"}), RELAY_MODEL),
               (_model("r3", x, out, {**d, "WAIT": "yes", "OUTPUT": "OUT"}), RELAY_MODEL),
               (_ensemble("relay", [("head_r", {"IN": "IN"}, {"X": "x"}), ("r1", {"X": "x"}, {"KEY": "R1"}),
                                    ("r2", {"X": "x"}, {"KEY": "R2"}), ("r3", {"X": "x"}, {"OUT": "OUT"})],
                          {"OUT": TICKET, "R1": KEY, "R2": KEY}), "")]
    # relay_join: head -> {j1, j2}; j1 -> j2 over ZeroMQ; (j1's key, j2's payload) -> join.
    models += [(_model("head_j", {"IN": TICKET}, x, {"ROLE": "head"}), RELAY_MODEL),
               (_model("j1", x, key, {**d, "PUSH_TO": "j2"}), RELAY_MODEL),
               (_model("j2", x, out, {**d, "WAIT": "yes", "OUTPUT": "OUT"}), RELAY_MODEL),
               (_model("join", {"KEY": KEY, "IN": TICKET}, out, {}), JOIN_MODEL),
               (_ensemble("relay_join", [("head_j", {"IN": "IN"}, {"X": "x"}), ("j1", {"X": "x"}, {"KEY": "k1"}),
                                         ("j2", {"X": "x"}, {"OUT": "y2"}), ("join", {"KEY": "k1", "IN": "y2"}, {"OUT": "OUT"})],
                          {"OUT": TICKET}), "")]
    # relay_early: head -> {e1, e2}, which answer with the key at once; e1 -> e2 -> tail over ZeroMQ,
    # off the ensemble's path; the tail's step follows the two answers and waits for e2's hand-over.
    models += [(_model("head_e", {"IN": TICKET}, x, {"ROLE": "head"}), RELAY_MODEL),
               (_model("e1", x, key, {**d, "PUSH_TO": "e2", "EARLY": "yes"}), RELAY_MODEL),
               (_model("e2", x, key, {**d, "WAIT": "yes", "PUSH_TO": "tail_e", "EARLY": "yes"}), RELAY_MODEL),
               (_model("tail_e", {**x, "K1": KEY, "K2": KEY}, out, {**d, "WAIT": "yes", "OUTPUT": "OUT"}), RELAY_MODEL),
               (_ensemble("relay_early", [("head_e", {"IN": "IN"}, {"X": "x"}), ("e1", {"X": "x"}, {"KEY": "k1"}),
                                          ("e2", {"X": "x"}, {"KEY": "k2"}),
                                          ("tail_e", {"X": "x", "K1": "k1", "K2": "k2"}, {"OUT": "OUT"})],
                          {"OUT": TICKET}), "")]
    return models


def write_repository(repo: Path, relay_dir: Path, laps_dir: Path, ensembles: tuple[str, ...] = ENSEMBLES) -> None:
    """The ``ensembles`` and the models their steps run."""
    models = configs(relay_dir, laps_dir)
    wanted = {step.model_name for cfg, _ in models if cfg.name in ensembles for step in cfg.ensemble_scheduling.step}
    for cfg, source in models:
        if cfg.name not in ensembles and cfg.name not in wanted:
            continue
        (repo / cfg.name / "1").mkdir(parents=True)
        (repo / cfg.name / "config.pbtxt").write_text(text_format.MessageToString(cfg))
        if source:
            (repo / cfg.name / "1" / "model.py").write_text(source)


def check(url: str, model: str, requests: int = 400, clients: int = 32, only_out: bool = False) -> int:
    """Distinct random inputs from ``clients`` concurrent clients, every output asked for (``only_out``:
    ``OUT`` alone); how many came back different or failed (must be 0)."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 256, size=(requests, 1, TICKET), dtype=np.uint8)

    def one(i: int) -> bool:
        client = httpclient.InferenceServerClient(url, network_timeout=60)
        try:
            inp = httpclient.InferInput("IN", [1, TICKET], "UINT8")
            inp.set_data_from_numpy(inputs[i])
            asked = [httpclient.InferRequestedOutput("OUT")] if only_out else None
            got = client.infer(model, [inp], outputs=asked).as_numpy("OUT")
            return got is not None and np.array_equal(got, inputs[i])
        except InferenceServerException:
            return False
        finally:
            client.close()

    with ThreadPoolExecutor(clients) as pool:
        return sum(not ok for ok in pool.map(one, range(requests)))


def run(out: Path, seconds: float, repeats: int) -> dict[str, Any]:
    repo = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    relay_dir = Path(tempfile.mkdtemp(prefix="bench-relay-sock-"))  # private (0700), as a runtime directory is
    laps_dir = Path(tempfile.mkdtemp(prefix="bench-relay-laps-"))
    write_repository(repo, relay_dir, laps_dir)
    runs: dict[str, list[dict[str, float]]] = {}
    with TritonServer(ServerOptions.on_free_ports([repo])) as server:
        mismatches = {m: check(server.http_url, m) for m in ENSEMBLES}
        if any(mismatches.values()):
            raise RuntimeError(f"an ensemble gave back something else than its input: {mismatches}")
        # What a client asking for OUT alone gets from each (the relay's middle steps pruned: a failure).
        only_out = {m: check(server.http_url, m, requests=2, clients=1, only_out=True) for m in ENSEMBLES}
        for model in ENSEMBLES:  # warm-up, not recorded
            perf_analyzer(server.http_url, model, f"IN:{TICKET}", 1, seconds / 2, concurrency=1)
        for _, conc, model in itertools.product(range(repeats), (1, 32), ENSEMBLES):
            r = perf_analyzer(server.http_url, model, f"IN:{TICKET}", 1, seconds, concurrency=conc)
            if "error" in r:
                raise RuntimeError(f"perf_analyzer on {model} at c{conc}: {r.get('message', r)}")
            runs.setdefault(f"{model}|c{conc}", []).append(r)
        stats = {name: {k: st[f"{k}_ns"] / max(st["requests"], 1) / 1e3 for k in ("queue", "compute_infer")}
                 for name, st in model_stats(server.http_url).items() if name not in ENSEMBLES}
    rows = {model: {"c1": median_of(runs[f"{model}|c1"]), "c32": median_of(runs[f"{model}|c32"])} for model in ENSEMBLES}
    for model in ENSEMBLES[1:]:
        rows[model]["hop_ms"] = (rows[model]["c1"]["p50_ms"] - rows["chain1"]["c1"]["p50_ms"]) / 3
    result = {"meta": {"device": device_name(), "commit": commit(), "seconds": seconds, "repeats": repeats,
                       "check": {"requests": 400, "clients": 32, "mismatches": mismatches, "only_out_failed": only_out}},
              "rows": rows, "runs": runs, "stats_us": stats}
    return write_results(out, result, report)


def report(res: dict[str, Any]) -> str:
    meta, rows = res["meta"], res["rows"]
    lines = [f"# A chain of ensemble steps against a relay over ZeroMQ, {meta['device']}, commit {meta.get('commit', '?')}", "",
             f"perf_analyzer over HTTP, batch 1, {meta['seconds']} s windows, median of {meta['repeats']} runs in turns "
             "(± half their range). Every model moves 256 bytes; hop = (p50 of the 4-step ensemble − p50 of the "
             f"1-step chain) / 3. Checked first: {meta['check']['requests']} distinct inputs from "
             f"{meta['check']['clients']} concurrent clients per ensemble, mismatches "
             + ", ".join(f"{k} {v}" for k, v in meta["check"]["mismatches"].items()) + "; of 2 requests asking for `OUT` "
             "alone, failed: " + ", ".join(f"{k} {v}" for k, v in meta["check"].get("only_out_failed", {}).items()) + ".", "",
             "| ensemble | on the request's path | c1 p50 | hop | c32 |", "|---|---|---|---|---|"]
    path = {"chain1": "1 step", "chain4": "4 steps, one after another", "relay": "1 step, a fan-out, 2 ZeroMQ hand-overs",
            "relay_join": "2 steps, a fan-out, 1 ZeroMQ hand-over",
            "relay_early": "2 steps whose middle ones answer at once, a fan-out; 2 ZeroMQ hand-overs beside them"}
    for model in ENSEMBLES:
        r = rows[model]
        hop = f"{r['hop_ms']:.3f} ms" if "hop_ms" in r else "—"
        lines.append(f"| `{model}` | {path[model]} | {r['c1']['p50_ms']:.3f} ms{spread_text(r['c1'], 'p50_ms')} | {hop} | "
                     f"{r['c32']['throughput']:.0f}/s{spread_text(r['c32'], 'throughput')} |")
    lines += ["", "Triton's statistics per request of each model over the whole run (µs; a relay model's compute "
              "includes its wait for the hand-over):", "", "| model | queue | compute infer |", "|---|---|---|"]
    for name, s in sorted(res["stats_us"].items()):
        lines.append(f"| {name} | {s['queue']:.0f} | {s['compute_infer']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(report(run(args.out, args.seconds, args.repeats)))


if __name__ == "__main__":
    main()
