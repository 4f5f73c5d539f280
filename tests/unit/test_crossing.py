"""Plans that span servers (blockflow.plan.crossing): the runs of a path, what the checks refuse,
and each server's repository (tests/plans/servers/cross.yaml)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from blockflow.core.errors import GenerateError, PlanError
from blockflow.core.spec import BRIDGE_PARAMETER, BridgeSpec
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt
from blockflow.plan import crossing, load_plan, parse_plan

PLAN = Path(__file__).resolve().parents[2] / "tests" / "plans" / "servers" / "cross.yaml"


def _raw() -> Any:
    return yaml.safe_load(PLAN.read_text())


def test_a_path_is_cut_into_runs_per_server() -> None:
    plan = load_plan(PLAN)
    assert crossing.runs(plan, plan.tasks["x_cross"]) == [("edge", ("x_stem",)), ("cloud", ("x_head",))]
    assert crossing.runs(plan, plan.tasks["x_far"]) == [("cloud", ("x_far_whole",))]
    assert not crossing.crosses(plan, plan.tasks["x_local"])


@pytest.mark.parametrize(("change", "says"), [
    (lambda r: r["blocks"]["x_head"].update(server="moon"), r"blocks\.x_head\.server.*no server 'moon'"),
    (lambda r: r["tasks"]["x_cross"].pop("transport"), r"tasks\.x_cross\.transport.*crosses servers \(edge → cloud\)"),
    (lambda r: r.update(fuse="auto"), r"fuse: 'auto' is not served across servers"),
    (lambda r: r.update(references=["eager"]), r"references is not served across servers"),
    (lambda r: r["blocks"]["x_stem"].update(precision="bf16"), r"bf16 activations cannot cross servers"),
    (lambda r: r.pop("servers"), r"blocks\.x_head\.server.*names no servers"),
])
def test_the_checks_refuse_what_a_crossing_cannot_serve(change: Any, says: str) -> None:
    raw = _raw()
    change(raw)
    with pytest.raises(PlanError, match=says):
        parse_plan(raw)


def test_each_server_gets_its_runs_and_the_crossing_between_them() -> None:
    plan = load_plan(PLAN)
    with pytest.raises(GenerateError, match="spans servers"):
        generator.render(plan)
    with pytest.raises(PlanError, match="no server 'moon'"):
        plan.on_server("moon")
    edge = generator.render(plan.on_server("edge"))
    cloud = generator.render(plan.on_server("cloud"))
    assert generator.model_names(edge) == ["x_cross", "x_cross__cross1", "x_local", "x_stem__triton_cpu", "x_whole"]
    assert generator.model_names(cloud) == ["x_cross__run1", "x_far", "x_far_whole", "x_head__triton_cpu"]
    ensemble = parse_pbtxt(edge["x_cross/config.pbtxt"].decode())
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["x_stem__triton_cpu", "x_cross__cross1"]
    assert [o.name for o in ensemble.output] == ["LOGITS"]
    bridge = parse_pbtxt(edge["x_cross__cross1/config.pbtxt"].decode())
    spec = BridgeSpec.model_validate(json.loads(bridge.parameters[BRIDGE_PARAMETER].string_value))
    assert (spec.grpc, spec.model, spec.timeout_s, spec.outputs) == ("127.0.0.1:18102", "x_cross__run1", 3.0, ("LOGITS",))
    assert [list(i.dims) for i in bridge.input] == [[128, 4, 4]] and b"blockflow.backend.bridge" in edge["x_cross__cross1/1/model.py"]
    # It batches the requests that queue while its instances are busy, up to the onward blocks' batch.
    assert bridge.HasField("dynamic_batching") and spec.max_batch_size == plan.blocks["x_head"].max_batch_size == 4
    run = parse_pbtxt(cloud["x_cross__run1/config.pbtxt"].decode())
    assert [(i.name, list(i.dims)) for i in run.input] == [("ACTIVATION_IN", [128, 4, 4])]
    assert dict(run.ensemble_scheduling.step[0].input_map) == {"ACTIVATION_IN": "ACTIVATION_IN"}


def test_serve_lists_only_this_servers_part_of_each_task() -> None:
    from types import SimpleNamespace

    from blockflow.cli.app import out
    from blockflow.cli.serve import _print_endpoints

    plan = load_plan(PLAN)
    urls = SimpleNamespace(http_url="http://127.0.0.1:1", grpc_url="127.0.0.1:2", metrics_url="http://127.0.0.1:3")
    printed = {}
    for name in ("edge", "cloud"):
        with out.capture() as captured:
            _print_endpoints(SimpleNamespace(plan=plan.on_server(name), server=urls, seconds_to_ready=1.0, control=None), None)  # type: ignore[arg-type]
        printed[name] = captured.get()
    assert "x_stem → (server cloud)" in printed["edge"] and "x_far" not in printed["edge"]
    assert "x_cross__run1" in printed["cloud"] and "x_local" not in printed["cloud"]
    assert "infer x_far" in printed["cloud"]  # a task that starts there
