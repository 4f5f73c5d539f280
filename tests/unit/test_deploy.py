"""The container recipe and the Helm chart say what BlockFlow needs. `scripts/check_deploy.sh` lints and
validates them with hadolint, helm and kubeconform; these tests read what `helm template` renders."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "blockflow"


def helm() -> str:
    found = shutil.which("helm", path=str(Path(os.environ.get("BLOCKFLOW_TOOLS", ROOT / ".tools")) / "bin")) or shutil.which("helm")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing; scripts/test.sh builds it (scripts/check_deploy.sh) before pytest")
        pytest.skip("no helm: run scripts/check_deploy.sh once")
    return found


def render(*args: str) -> dict[str, dict[str, Any]]:
    text = subprocess.run([helm(), "template", "bf", str(CHART), *args], capture_output=True, text=True, check=True).stdout
    return {d["kind"]: d for d in yaml.safe_load_all(text) if d}


def test_the_chart_serves_the_default_plan_from_its_copy() -> None:
    assert (CHART / "files" / "plan.yaml").read_text() == (ROOT / "plans" / "default.yaml").read_text(), \
        "deploy/helm/blockflow/files/plan.yaml must be a copy of plans/default.yaml (cp it)"
    objects = render()
    assert objects["ConfigMap"]["data"]["plan.yaml"].strip() == (ROOT / "plans" / "default.yaml").read_text().strip()


def test_the_pod_is_ready_with_its_models_and_scraped_on_the_metrics_port() -> None:
    pod = render()["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    # Through the control service (it starts after Triton is ready): a ready pod takes `blockflow apply`.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "control"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health/ready", "port": "control"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002, "control": 8003}
    assert container["args"][:3] == ["serve", "--host=0.0.0.0", "--plan=/etc/blockflow/plan.yaml"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_root_filesystem_is_read_only_with_tmp_and_shm_volumes() -> None:
    """What tests/integration/test_read_only_root.py runs serve under: only /tmp and /dev/shm writable, HOME in /tmp."""
    container = render()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")} == {"/tmp", "/dev/shm"}
    assert next(e for e in container["env"] if e["name"] == "HOME")["value"].startswith("/tmp/")
    off = render("--set", "readOnlyRootFilesystem=false")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert off["securityContext"]["readOnlyRootFilesystem"] is False


def test_the_control_token_comes_from_a_secret() -> None:
    objects = render()
    env = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "BLOCKFLOW_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": objects["Secret"]["metadata"]["name"], "key": "token"}
    own = render("--set", "controlToken.existingSecret=mine", "--set", "controlToken.key=bearer")
    assert "Secret" not in own
    own_env = own["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert next(e for e in own_env if e["name"] == "BLOCKFLOW_TOKEN")["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "bearer"}


def test_a_new_plan_rolls_the_pods_and_unknown_values_are_refused() -> None:
    def checksum(*args: str) -> str:
        return str(render(*args)["Deployment"]["spec"]["template"]["metadata"]["annotations"]["checksum/plan"])

    assert checksum() != checksum("--set-file", f"plan={ROOT / 'tests' / 'plans' / 'one_block.yaml'}")
    res = subprocess.run([helm(), "template", "bf", str(CHART), "--set", "replicas=2"], capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "additional properties 'replicas' not allowed" in res.stderr


def test_the_image_installs_every_package_the_wheel_has() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    copied = set(re.findall(r"^COPY (\S+)/ ", (ROOT / "Dockerfile").read_text(), flags=re.M))
    assert {p.split(".")[0] for p in packages} <= copied


def test_a_weights_volume_is_mounted_read_only_and_opened_to_posted_plans() -> None:
    objects = render("-f", str(ROOT / "deploy" / "helm" / "ci" / "plan-history.yaml"))
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "weights", "mountPath": "/weights", "readOnly": True} in container["volumeMounts"]
    assert {"name": "weights", "nfs": {"server": "nfs.example.com", "path": "/exports/weights"}} in pod["volumes"]
    assert "--weights-dir=/weights" in container["args"]
    assert "/weights/resnet50.safetensors" in objects["ConfigMap"]["data"]["plan.yaml"]  # the plan reads it there
    assert "--weights-dir=/weights" not in render()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_plan_history_outlives_the_pod_on_a_claim_one_server_at_a_time() -> None:
    objects = render("-f", str(ROOT / "deploy" / "helm" / "ci" / "plan-history.yaml"))
    deployment = objects["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--state-dir=/var/lib/blockflow/plans" in container["args"]
    assert {"name": "plan-history", "mountPath": "/var/lib/blockflow"} in container["volumeMounts"]
    claim = objects["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOncePod"] and claim["spec"]["storageClassName"] == "fast"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    mine = render("--set", "planHistory.persistence=true", "--set", "planHistory.existingClaim=mine")
    assert "PersistentVolumeClaim" not in mine
    assert {"name": "plan-history", "persistentVolumeClaim": {"claimName": "mine"}} in mine["Deployment"]["spec"]["template"]["spec"]["volumes"]
    res = subprocess.run([helm(), "template", "bf", str(CHART), "--set", "planHistory.persistence=true", "--set", "replicaCount=2"],
                         capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "set replicaCount to 1" in res.stderr
    assert "--state-dir=/var/lib/blockflow/plans" not in render()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_service_monitor_disruption_budget_and_network_policy_when_asked() -> None:
    assert not {"ServiceMonitor", "PodDisruptionBudget", "NetworkPolicy"} & set(render())
    objects = render("-f", str(ROOT / "deploy" / "helm" / "ci" / "everything.yaml"))
    monitor = objects["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    triton, serve = monitor["spec"]["endpoints"]
    assert triton["port"] == "metrics" and serve["port"] == "control" and serve["path"] == "/metrics"
    assert serve["authorization"]["credentials"] == {"name": "blockflow-token", "key": "bearer"}  # the control token
    assert objects["PodDisruptionBudget"]["spec"]["minAvailable"] == 2
    rules = objects["NetworkPolicy"]["spec"]["ingress"]
    assert [sorted(p["port"] for p in r["ports"]) for r in rules] == [[8000, 8001], [8002], [8003]]
    assert rules[2]["from"] == [{"podSelector": {"matchLabels": {"app": "optimizer"}}}]
    no_control = render("--set", "networkPolicy.enabled=true")["NetworkPolicy"]["spec"]["ingress"]
    assert len(no_control) == 2 and "from" not in no_control[0]  # inference from anywhere; control from nowhere


def test_a_release_serves_its_server_of_a_plan_across_servers() -> None:
    objects = render("-f", str(ROOT / "deploy" / "helm" / "ci" / "crossing-edge.yaml"))
    assert "--server=edge" in objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--server") for a in render()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"])
    res = subprocess.run([helm(), "template", "bf", str(CHART), "--set", "server=no way"], capture_output=True, text=True,
                         check=False)
    assert res.returncode != 0 and "server" in res.stderr
