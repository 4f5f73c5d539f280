"""Side inputs on the client side, without a server: what a task's metadata says it takes, the checks
before a call, the request both protocols build, and ``blockflow infer --input NAME=FILE.npy``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from blockflow.bench.perf_analyzer import encoded_input_data
from blockflow.clients.client import TaskClient
from blockflow.clients.task_input import SideInputKind, TaskInput
from blockflow.core.errors import ClientError
from blockflow.core.spec import LOGITS, SideInput

# Triton's metadata of a task ensemble (max_batch_size > 0) that takes IMAGE and `size`.
SIZED = {"name": "sized", "platform": "ensemble",
         "inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 3, 16, 16]},
                    {"name": "size", "datatype": "INT64", "shape": [-1, 2]}],
         "outputs": [{"name": "boxes", "datatype": "FP32", "shape": [-1, 4]},
                     {"name": "area", "datatype": "INT64", "shape": [-1, 1]}]}
SCALED = {"name": "scaled", "inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 3, 16, 16]},
                                       {"name": "scale", "datatype": "FP32", "shape": [-1, 1]}],
          "outputs": [{"name": LOGITS, "datatype": "FP32", "shape": [-1, 10]}]}
PLAIN = {"name": "plain", "inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 3, 16, 16]}],
         "outputs": [{"name": LOGITS, "datatype": "FP32", "shape": [-1, 10]}]}
SIZE = SideInputKind("size", "INT64", (2,))


def _grpc(meta: dict[str, Any]) -> Any:
    """``meta`` as gRPC's metadata message reads (attributes, not keys)."""
    return SimpleNamespace(inputs=[SimpleNamespace(**i) for i in meta["inputs"]],
                           outputs=[SimpleNamespace(**o) for o in meta["outputs"]])


def test_a_tasks_metadata_lists_its_side_inputs_after_the_image() -> None:
    for meta in (SIZED, _grpc(SIZED)):
        kind = TaskInput.of(meta)
        assert kind.datatype == "FP32" and kind.shape == (3, 16, 16) and kind.outputs == ("boxes", "area")
        assert kind.side_inputs == (SIZE,)
        assert kind.side_inputs[0].dtype == np.int64 and str(kind.side_inputs[0]) == "size (int64 [batch, 2])"
    [scale] = TaskInput.of(SCALED).side_inputs
    assert scale == SideInputKind("scale", "FP32", (1,)) and scale.dtype == np.float32
    encoded = TaskInput.of({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, -1]},
                                       {"name": "size", "datatype": "INT64", "shape": [-1, 2]}]})
    assert encoded.encoded and encoded.side_inputs == (SIZE,)
    assert TaskInput.of(PLAIN).side_inputs == ()
    # A block's hop tensors are no side inputs; a model without IMAGE lists none.
    hop = {"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 3, 16, 16]},
                      {"name": "HANDED_AFTER_0", "datatype": "UINT8", "shape": [-1, 256]}]}
    assert TaskInput.of(hop).side_inputs == ()
    block = {"inputs": [{"name": "ACTIVATION_IN", "datatype": "FP32", "shape": [-1, 8, 4, 4]},
                        {"name": "size", "datatype": "INT64", "shape": [-1, 2]}]}
    assert TaskInput.of(block).side_inputs == ()


def test_side_inputs_are_checked_before_a_call_and_named_in_each_refusal() -> None:
    kind = TaskInput.of(SIZED)
    ok = np.array([[16, 16], [8, 12]], np.int64)
    sent = kind.check_sides("sized", {"size": ok}, 2)
    assert list(sent) == ["size"] and sent["size"].dtype == np.int64 and np.array_equal(sent["size"], ok)
    assert np.array_equal(kind.check_sides("sized", {"size": torch.from_numpy(ok)}, 2)["size"], ok)
    assert kind.check_sides("sized", {"size": [[16, 16], [8, 12]]}, 2)["size"].dtype == np.int64  # Python ints: exact
    with pytest.raises(ClientError, match=r"task 'sized' needs its side input\(s\) size \(int64 \[batch, 2\]\).*inputs=\{'size'"):
        kind.check_sides("sized", None, 2)
    with pytest.raises(ClientError, match=r"takes no input 'sise': its inputs besides IMAGE are size \(int64 \[batch, 2\]\)"):
        kind.check_sides("sized", {"size": ok, "sise": ok}, 2)
    with pytest.raises(ClientError, match=r"side input 'size' of task 'sized' takes int64 \[batch, 2\], got float32"):
        kind.check_sides("sized", {"size": ok.astype(np.float32)}, 2)  # an array of another dtype: never cast
    with pytest.raises(ClientError, match="takes int64 .*float64 values do not convert to int64 exactly"):
        kind.check_sides("sized", {"size": [[16.5, 16], [8, 12]]}, 2)
    with pytest.raises(ClientError, match=r"takes int64 \[batch, 2\] with the images' batch 3; got shape \[2, 2\]"):
        kind.check_sides("sized", {"size": ok}, 3)
    with pytest.raises(ClientError, match=r"with the images' batch 2; got shape \[2, 3\]"):
        kind.check_sides("sized", {"size": np.zeros((2, 3), np.int64)}, 2)
    with pytest.raises(ClientError, match="takes no input 'size': its inputs besides IMAGE are none"):
        TaskInput.of(PLAIN).check_sides("plain", {"size": ok}, 2)
    assert TaskInput.of(PLAIN).check_sides("plain", None, 2) == {}
    scaled = TaskInput.of(SCALED)
    assert scaled.check_sides("scaled", {"scale": [[0.1]]}, 1)["scale"].dtype == np.float32  # a Python float: rounded
    assert scaled.check_sides("scaled", {"scale": [[3]]}, 1)["scale"].tolist() == [[3.0]]
    with pytest.raises(ClientError, match="int64 values do not convert to float32 exactly"):
        scaled.check_sides("scaled", {"scale": [[2**24 + 1]]}, 1)
    with pytest.raises(ClientError, match="float64 values do not convert to float32 exactly"):
        scaled.check_sides("scaled", {"scale": [[1e300]]}, 1)
    with pytest.raises(ClientError, match="got float64"):
        scaled.check_sides("scaled", {"scale": np.ones((1, 1))}, 1)


class _Result:
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def as_numpy(self, name: str) -> Any:
        return np.zeros((self.batch, 4 if name == "boxes" else 1 if name == "area" else 10), np.int64 if name == "area" else np.float32)

    def get_response(self) -> dict[str, str]:
        return {"id": ""}


class _Triton:
    """tritonclient's client, answering from ``METADATA`` and recording each call's inputs."""

    METADATA = {"sized": SIZED, "scaled": SCALED, "plain": PLAIN}

    def __init__(self, *_: Any, **__: Any) -> None:
        self.calls: list[list[tuple[str, str, list[int], bytes]]] = []

    def get_model_metadata(self, task: str, *_: Any, **__: Any) -> Any:
        return self.METADATA[task]

    def infer(self, task: str, inputs: list[Any], **_: Any) -> _Result:
        self.calls.append([(i.name(), i.datatype(), i.shape(), getattr(i, "_raw_data", None) or i._raw_content) for i in inputs])
        return _Result(inputs[0].shape()[0])

    def close(self) -> None:
        pass


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_call_sends_its_side_inputs_as_plain_tensors_after_the_image(protocol: str) -> None:
    with TaskClient("127.0.0.1:1", protocol) as client:  # type: ignore[arg-type]
        client._client = fake = _Triton()
        images, size = np.zeros((2, 3, 16, 16), np.float32), np.array([[16, 16], [8, 12]], np.int64)
        outs = client.infer_outputs("sized", images, inputs={"size": size})
        assert set(outs) == {"boxes", "area"} and outs["boxes"].shape == (2, 4)
        [(image, sent)] = [fake.calls[-1]]
        assert image[:3] == ("IMAGE", "FP32", [2, 3, 16, 16]) and sent == ("size", "INT64", [2, 2], size.tobytes())
        client.infer("scaled", images, inputs={"scale": [[0.5], [2.0]]})
        assert fake.calls[-1][1][:3] == ("scale", "FP32", [2, 1])
        assert np.frombuffer(fake.calls[-1][1][3], np.float32).tolist() == [0.5, 2.0]
        client.infer("plain", images)  # a task without side inputs: the image alone, as ever
        assert [i[0] for i in fake.calls[-1]] == ["IMAGE"]
        calls = len(fake.calls)
        with pytest.raises(ClientError, match="needs its side input"):
            client.infer_outputs("sized", images)
        with pytest.raises(ClientError, match="batch 2; got shape"):
            client.infer_outputs("sized", images, inputs={"size": size[:1]})
        assert len(fake.calls) == calls  # refused before sending
        assert client.input_of("sized").side_inputs == (SIZE,)


def test_bench_input_data_gives_each_entry_the_side_inputs(tmp_path: Path) -> None:
    sides = (SideInput(name="size", dtype="int64", shape=(2,)), SideInput(name="scale", dtype="fp32", shape=(1,)))
    data = json.loads(encoded_input_data(tmp_path / "in.json", sides=sides).read_text())["data"]
    assert data and all(e["size"] == {"content": [1, 1], "shape": [2]} and e["scale"] == {"content": [1.0], "shape": [1]}
                        for e in data)
    assert all(set(e) == {"IMAGE"} for e in json.loads(encoded_input_data(tmp_path / "plain.json").read_text())["data"])


# ------------------------------------------------------------------ blockflow infer --input NAME=FILE.npy


def _infer(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, _Triton]:
    """``blockflow infer ARGS`` in this process, against :class:`_Triton`: exit code, stdout and stderr, the calls."""
    import tritonclient.http

    from blockflow.cli import main

    fake = _Triton()
    monkeypatch.setattr(tritonclient.http, "InferenceServerClient", lambda *a, **k: fake)
    with pytest.raises(SystemExit) as done:
        main(["infer", *args, "--url", "127.0.0.1:1", "--random"])
    printed = capsys.readouterr()
    return int(done.value.code or 0), printed.out + printed.err, fake


def test_infer_sends_each_input_file(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    np.save(tmp_path / "one.npy", np.array([16, 8], np.int64))  # one sample's: repeated over the batch
    code, printed, fake = _infer(monkeypatch, capsys, "sized", "--batch", "3", "--input", f"size={tmp_path / 'one.npy'}")
    assert code == 0, printed
    [(_, size)] = [fake.calls[-1]]
    assert size[:3] == ("size", "INT64", [3, 2]) and np.frombuffer(size[3], np.int64).tolist() == [16, 8] * 3
    # A task that answers named outputs: each one's shape and values, per sample.
    assert "sized sample 2: boxes [4] [0, 0, 0, 0]; area [1] [0]" in printed and "latency over 1 request(s)" in printed
    code, printed, fake = _infer(monkeypatch, capsys, "sized", "--json", "--input", f"size={tmp_path / 'one.npy'}")
    doc = json.loads(printed)
    assert code == 0 and doc["outputs"] == [{"boxes": [0.0] * 4, "area": [0]}] and set(doc["latency_ms"]) == {"p50", "p99", "min"}
    np.save(tmp_path / "scale.npy", np.array([[0.5], [2.0]], np.float32))  # a batch's
    code, printed, fake = _infer(monkeypatch, capsys, "scaled", "--batch", "2", "--input", f"scale={tmp_path / 'scale.npy'}")
    assert code == 0 and "scaled sample 1: " in printed, printed
    assert np.frombuffer(fake.calls[-1][1][3], np.float32).tolist() == [0.5, 2.0]


def test_infer_says_what_is_wrong_with_an_input(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    np.save(tmp_path / "size.npy", np.array([16, 8], np.int64))
    np.save(tmp_path / "floats.npy", np.array([16.0, 8.0]))
    (tmp_path / "text.npy").write_text("not numpy")
    cases = [
        (["sized", "--input", "size"], 2, "Invalid value for --input: 'size' is not NAME=FILE.npy"),
        (["sized", "--input", f"={tmp_path / 'size.npy'}"], 2, "is not NAME=FILE.npy"),
        (["sized", "--input", f"size={tmp_path / 'nope.npy'}"], 2, "cannot read"),
        (["sized", "--input", f"size={tmp_path / 'text.npy'}"], 2, "cannot read"),
        (["sized", "--input", f"size={tmp_path / 'size.npy'}", "--input", f"size={tmp_path / 'size.npy'}"], 2, "given twice"),
        (["sized", "--input", f"sise={tmp_path / 'size.npy'}"], 2, "task 'sized' takes no input 'sise' (its side inputs: size (int64"),
        (["plain", "--input", f"size={tmp_path / 'size.npy'}"], 2, "task 'plain' takes no input 'size' (its side inputs: none)"),
        (["sized"], 2, "takes side input(s) size (int64 [batch, 2]): give --input size=FILE.npy"),
        (["sized", "--input", f"size={tmp_path / 'floats.npy'}"], 5, "takes int64 [batch, 2], got float64"),
    ]
    for args, code, says in cases:
        got, err, fake = _infer(monkeypatch, capsys, *args)
        assert got == code and says in err and "Traceback" not in err, (args, got, err)
        assert len(err.strip().splitlines()) == 1 and not fake.calls, (args, err)


def test_bench_input_directory_gives_one_samples_bytes_per_input(tmp_path: Path) -> None:
    from blockflow.bench.perf_analyzer import side_input_data

    sides = (SideInput(name="size", dtype="int64", shape=(2,)), SideInput(name="scale", dtype="fp32", shape=(1,)))
    where = side_input_data(tmp_path / "in", (3, 16, 16), False, sides)
    assert sorted(p.name for p in where.iterdir()) == ["IMAGE", "scale", "size"]
    assert (where / "IMAGE").stat().st_size == 3 * 16 * 16 * 4
    assert np.frombuffer((where / "size").read_bytes(), dtype=np.int64).tolist() == [1, 1]
    assert (side_input_data(tmp_path / "u8", (16, 16, 3), True, ()) / "IMAGE").stat().st_size == 16 * 16 * 3
