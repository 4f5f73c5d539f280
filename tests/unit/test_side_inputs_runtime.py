"""Side inputs in the block runtime (CPU): blocks and fused parts take them after their hop tensors and,
chained, equal the exported program run whole; bad ones fail the request that gave them."""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend import instance_args
from blockflow.backend.parts import Chain
from blockflow.backend.runtime import BlockRunner
from blockflow.core import arch
from blockflow.core.errors import RequestError
from blockflow.core.programs import program_output_names
from blockflow.core.side_inputs import side_inputs, stage_side_inputs
from blockflow.core.spec import ModelSpec, Part, SideInput, TransportName, WeightsSource

from .. import side_programs
from ..conftest import tensor_error
from ..stub_stand_in import with_pb_utils

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("side_programs")
    return {"sized_boxes": side_programs.sized_boxes(where), "scaled": side_programs.scaled(where)}


def _spec(path: Path, cuts: Sequence[str], blocks: Sequence[tuple[int, int]], transport: TransportName = "triton-cpu",
          name: str = "b") -> ModelSpec:
    """A spec running stages ``blocks`` (each a part: first, last) of program ``path`` cut at ``cuts``."""
    network = str(path)
    found = arch.legal_cuts(network, (), 0)
    assert set(cuts) <= set(found.names())
    shapes = arch.stage_output_shapes(network, cuts, (), 0)
    first, last = blocks[0][0], blocks[-1][1]
    ins = (found.input_shape,) if first == 0 else shapes[first - 1]
    outs = shapes[last]
    parts = tuple(Part(block=f"{name}{k}", first=a, last=b, weights=WeightsSource(seed=0),
                       side_inputs=stage_side_inputs(network, cuts, (), 0, a, b)) for k, (a, b) in enumerate(blocks))
    read = {n for p in parts for n in p.side_inputs}
    return ModelSpec(kind="block", name=name, arch=network, cut_points=tuple(cuts), num_classes=0,
                     input_shape=found.input_shape, parts=parts, precision="fp32", cuda_graphs=False, max_batch_size=8,
                     transport=transport, in_shape=ins[0], out_shape=outs[0], extra_in_shapes=ins[1:],
                     extra_out_shapes=outs[1:], outputs=arch.task_outputs(network, found.input_shape) if last == len(cuts) else (),
                     side_inputs=tuple(s for s in side_inputs(network, (), 0) if s.name in read))


def _whole(path: Path, image: torch.Tensor, side: torch.Tensor) -> list[torch.Tensor]:
    """The program run whole: its outputs in the order the runtime gives them."""
    with torch.inference_mode():
        out = torch.export.load(path).module()(image, side)
    if isinstance(out, dict):
        return [out[n] for n in program_output_names(str(path), len(out))]
    return [out]


def _sides(spec: ModelSpec, given: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [given[s.name] for s in spec.side_inputs]


def _inputs(name: str, batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    image = torch.randn(batch, 3, 16, 16)
    if name == "sized_boxes":
        return image, {"size": torch.randint(8, 1000, (batch, 2), dtype=torch.int64)}
    return image, {"scale": torch.rand(batch, 1) + 0.5}


def _close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = w.reshape(-1, 1) if w.dim() == 1 else w
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.is_floating_point():
            assert tensor_error(g, w) <= 1e-5
        else:
            assert torch.equal(g, w)


CASES = [("sized_boxes", ["stem", "body"]), ("scaled", ["stem", "body"]), ("scaled", ["body"])]


@pytest.mark.parametrize(("name", "cuts"), CASES)
def test_a_block_per_stage_chained_by_hand_equals_the_program(programs: dict[str, Path], name: str, cuts: list[str]) -> None:
    runners = [BlockRunner(_spec(programs[name], cuts, [(i, i)], name=f"s{i}"), CPU) for i in range(len(cuts) + 1)]
    assert any(r.spec.side_inputs for r in runners)
    for batch in (1, 3):
        image, given = _inputs(name, batch)
        xs: list[torch.Tensor] = [image]
        for r in runners:
            xs = r.run_all([*xs, *_sides(r.spec, given)])
        _close(xs, _whole(programs[name], image, *given.values()))


@pytest.mark.parametrize(("name", "cuts"), CASES)
def test_fused_parts_each_take_their_side_inputs(programs: dict[str, Path], name: str, cuts: list[str]) -> None:
    spec = _spec(programs[name], cuts, [(0, 0), (1, len(cuts))])
    runner = BlockRunner(spec, CPU)
    assert isinstance(runner.module, Chain) and runner.module.side_count == len(spec.side_inputs) > 0
    for batch in (1, 3):
        image, given = _inputs(name, batch)
        _close(runner.run_all([image, *_sides(spec, given)]), _whole(programs[name], image, *given.values()))


def test_wrong_side_inputs_are_request_errors(programs: dict[str, Path]) -> None:
    spec = _spec(programs["sized_boxes"], ["stem", "body"], [(0, 2)])
    assert [s.name for s in spec.side_inputs] == ["size"]
    runner = BlockRunner(spec, CPU)
    image = torch.randn(2, 3, 16, 16)
    with pytest.raises(RequestError, match="'size' is torch.float32"):
        runner.run_all([image, torch.ones(2, 2)])
    with pytest.raises(RequestError, match=r"'size' is torch.int64 \[2, 3\]; expected torch.int64 \[2, 2\]"):
        runner.run_all([image, torch.ones(2, 3, dtype=torch.int64)])
    with pytest.raises(RequestError, match="'size'.*expected torch.int64 \\[2, 2\\]"):
        runner.run_all([image, torch.ones(1, 2, dtype=torch.int64)])
    with pytest.raises(RequestError, match="1 input tensor"):
        runner.run_all([image])
    # Two requests joined (model.py, a call of several): each column on its own, the int64 one kept.
    sizes = [torch.tensor([[4, 6], [8, 2]]), torch.tensor([[3, 3]])]
    joined = runner.join([[image, image[:1]], sizes])
    assert joined[1].dtype == torch.int64 and torch.equal(joined[1], torch.cat(sizes))
    assert runner.run_all(joined)[1].tolist() == [[24], [16], [9]]


def test_warmup_and_bucket_padding_take_side_inputs(programs: dict[str, Path]) -> None:
    spec = _spec(programs["scaled"], ["body"], [(0, 0), (1, 1)])
    runner = BlockRunner(spec, CPU)
    runner.warmup()
    zeros = runner._zeros(4)
    assert [(z.dtype, z.shape) for z in zeros] == [(torch.float32, (4, 3, 16, 16)), (torch.float32, (4, 1))]
    # As on a GPU: a batch of 3 runs padded to its bucket of 4, its side inputs too.
    runner.is_cuda = True
    padded: list[int] = []
    eager = runner._eager
    runner._eager = lambda xs: padded.append(int(xs[-1].shape[0])) or eager(xs)  # type: ignore[method-assign]
    image, given = _inputs("scaled", 3)
    _close(runner.run_all([image, given["scale"]]), _whole(programs["scaled"], image, given["scale"]))
    assert padded == [4]


def test_tensor_names_list_side_inputs_after_the_hop(programs: dict[str, Path]) -> None:
    path = programs["sized_boxes"]
    first = _spec(path, ["stem", "body"], [(0, 2)], transport="tensormq")
    assert instance_args.tensor_names(first)[0] == ["IMAGE", "size"]
    last = _spec(path, ["stem", "body"], [(2, 2)], transport="tensormq")
    assert instance_args.tensor_names(last) == (["ACTIVATION_IN", "size"], ["boxes", "area"])
    plain = _spec(path, ["stem", "body"], [(2, 2)], transport="triton-gpu")
    assert instance_args.tensor_names(plain)[0] == [*(f"ACTIVATION_IN{'' if i == 0 else f'_{i}'}" for i in range(len(plain.in_shapes))),
                                                    "size"]
    middle = _spec(path, ["stem", "body"], [(1, 1)], transport="tensormq")
    assert not middle.side_inputs and instance_args.tensor_names(middle)[0] == ["ACTIVATION_IN"]


class _Dtypes(nn.Module):
    """Records the dtypes it is given; hands its first tensor on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        self.seen = [x.dtype for x in xs]
        return xs[0]


def test_a_chain_in_several_precisions_casts_each_part_s_floating_side_inputs() -> None:
    a, b = _Dtypes(), _Dtypes()
    chain = Chain([a, b], [torch.bfloat16, torch.float32], (2, [(1,), (0, 1)]))
    chain(torch.randn(2, 3), torch.ones(2, 2, dtype=torch.int64), torch.randn(2, 1))
    assert a.seen == [torch.bfloat16, torch.bfloat16]
    assert b.seen == [torch.float32, torch.int64, torch.float32]


# The input path, with a stand-in for the Python backend's triton_python_backend_utils.

class _TritonTensor:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to_dlpack(self) -> Any:
        return to_dlpack(self.t)

    def is_cpu(self) -> bool:
        return not self.t.is_cuda

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.t.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.t.__dlpack_device__()


class _Response:
    def __init__(self, output_tensors: Any = None, error: Any = None) -> None:
        self.output_tensors, self.error = output_tensors, error


class _Error:
    def __init__(self, message: str, *_: Any) -> None:
        self.message = message


@pytest.fixture()
def request_inputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with with_pb_utils(monkeypatch, "blockflow.backend.request_inputs", InferenceResponse=_Response, TritonError=_Error,
                       get_input_tensor_by_name=lambda request, name: request.get(name)) as module:
        yield module


class _Consumer:
    """Gives the views it is told to for any ticket, and one release (the slot they are in) per gather."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views
        self.gathered = 0

    def gather_tensors(self, tickets: Any, shapes: Any, stream: int, lap: Any) -> tuple[list[torch.Tensor], list[Any]]:
        self.gathered += 1
        return self.views, [("slot", self.gathered)]


def _reader(module: Any, spec: ModelSpec, consumer: _Consumer | None = None) -> Any:
    from blockflow.backend.trace import NoTracer

    ends = types.SimpleNamespace(consumer=consumer, relay=None)
    return module.RequestInputs(spec, instance_args.tensor_names(spec)[0], CPU, ends, 0, NoTracer())


def _request(**tensors: torch.Tensor) -> dict[str, _TritonTensor]:
    return {k: _TritonTensor(v) for k, v in tensors.items()}


def test_request_inputs_read_side_inputs_after_the_hop(programs: dict[str, Path], request_inputs: Any) -> None:
    spec = _spec(programs["sized_boxes"], ["stem", "body"], [(0, 2)])
    reader = _reader(request_inputs, spec)
    image, size = torch.randn(2, 3, 16, 16), torch.ones(2, 2, dtype=torch.int64)
    requests = [_request(IMAGE=image, size=size), _request(IMAGE=image, size=size.float()), _request(IMAGE=image),
                _request(IMAGE=image, size=size[:1])]
    responses: list[Any] = [None] * len(requests)
    batch, owners = reader.read_all(requests, responses, [])
    assert owners == [0] and torch.equal(batch[0][0], image) and torch.equal(batch[0][1], size)
    assert "'size' is torch.float32" in responses[1].error.message
    assert "no input 'size'" in responses[2].error.message
    assert "'size' is torch.int64 [1, 2]; expected torch.int64 [2, 2]" in responses[3].error.message


def test_tensormq_gathers_the_hop_and_reads_side_inputs_as_plain_tensors(programs: dict[str, Path], request_inputs: Any) -> None:
    spec = _spec(programs["sized_boxes"], ["stem", "body"], [(2, 2)], transport="tensormq")
    views = [torch.randn(3, *s) for s in spec.in_shapes]
    consumer = _Consumer(views)
    reader = _reader(request_inputs, spec, consumer)
    ticket, size = torch.zeros(3, 256, dtype=torch.uint8), torch.ones(3, 2, dtype=torch.int64)
    requests = [_request(ACTIVATION_IN=ticket, size=size), _request(ACTIVATION_IN=ticket, size=size[:, :1]),
                _request(ACTIVATION_IN=ticket, size=size[:2])]
    responses: list[Any] = [None] * len(requests)
    releases: list[Any] = []
    batch, owners = reader.read_all(requests, responses, releases)
    assert owners == [0] and len(batch[0]) == len(views) + 1
    assert all(a is b for a, b in zip(batch[0], views, strict=False)) and torch.equal(batch[0][-1], size)
    assert "'size'" in responses[1].error.message and "expected torch.int64 [3, 2]" in responses[2].error.message
    # A request its side inputs fail claims no slot (checked before its tickets are gathered): nothing to leak.
    assert consumer.gathered == 1 and releases == [("slot", 1)]


class _Decoder:
    """Decodes a file of one byte ``k`` into k-valued images; fails a file of byte 0."""

    def decode(self, requests: Sequence[Sequence[bytes]]) -> list[torch.Tensor | RequestError]:
        return [RequestError("cannot decode") if files[0][0] == 0 else torch.full((len(files), 3, 16, 16), files[0][0], dtype=torch.uint8)
                for files in requests]


def test_encoded_images_keep_their_request_s_side_inputs(programs: dict[str, Path], request_inputs: Any) -> None:
    spec = _spec(programs["sized_boxes"], ["stem", "body"], [(0, 2)])
    reader = _reader(request_inputs, spec)
    reader.decoder = _Decoder()

    def files(value: int, n: int) -> torch.Tensor:
        return torch.full((n, 4), value, dtype=torch.uint8)

    requests = [_request(IMAGE=files(1, 2), size=torch.full((2, 2), 1)), _request(IMAGE=files(2, 1), size=torch.ones(2, 2, dtype=torch.int64)),
                _request(IMAGE=files(0, 1), size=torch.full((1, 2), 3)), _request(IMAGE=files(4, 1), size=torch.full((1, 2), 4))]
    responses: list[Any] = [None] * len(requests)
    batch, owners = reader.read_all(requests, responses, [])
    assert owners == [0, 3]
    for xs, value, n in zip(batch, (1, 4), (2, 1), strict=True):
        assert xs[0].shape == (n, 3, 16, 16) and int(xs[0][0, 0, 0, 0]) == value
        assert xs[1].dtype == torch.int64 and torch.equal(xs[1], torch.full((n, 2), value))
    assert "expected torch.int64 [1, 2]" in responses[1].error.message and "cannot decode" in responses[2].error.message


def test_side_inputs_of_the_spec_keep_their_order(programs: dict[str, Path]) -> None:
    assert side_inputs(str(programs["scaled"]), (), 0) == (SideInput(name="scale", dtype="fp32", shape=(1,)),)
    assert side_inputs(str(programs["sized_boxes"]), (), 0) == (SideInput(name="size", dtype="int64", shape=(2,)),)


def test_a_programs_stages_make_their_tensors_on_the_blocks_device(tmp_path: Path) -> None:
    """An exported ``.to(dtype)`` asserts the CPU it was exported on, and ``arange(..., device=x.device)``
    names it: neither may pin a block on a GPU to the CPU."""
    from blockflow.backend.parts import on_device

    class Ramp(torch.nn.Module):
        def forward(self, image: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
            ramp = torch.arange(4, device=image.device, dtype=torch.float32)
            return image.mean((1, 2, 3)).reshape(-1, 1) * ramp + size.to(image.dtype)

    batch = torch.export.Dim("batch", min=1, max=64)
    path = tmp_path / "ramp.pt2"
    torch.export.save(torch.export.export(Ramp(), (torch.randn(2, 3, 8, 8), torch.ones(2, 4, dtype=torch.int64)),
                                          dynamic_shapes=({0: batch}, {0: batch})), path)
    stage = arch.stage_module(arch.trace(arch.build_network(str(path), 0, 0)), [], 0, 0)
    assert not any("_assert_tensor_metadata" in str(n.target) for n in stage.graph.nodes)
    meta = torch.device("meta")
    on_device(stage, meta)
    devices = [n.kwargs["device"] for n in stage.graph.nodes if "device" in n.kwargs]
    assert devices and all(d == meta for d in devices)
    out = stage(torch.empty(3, 3, 8, 8, device=meta), torch.empty(3, 4, dtype=torch.int64, device=meta))
    assert out.device == meta and tuple(out.shape) == (3, 4)
