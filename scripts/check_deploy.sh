#!/usr/bin/env bash
# Check the deployment files with the real tools, from nothing (CI has no Docker engine and no cluster):
#   hadolint on the Dockerfile; helm lint --strict and helm template of deploy/helm/blockflow (default values
#   and every values file under deploy/helm/ci/); kubeconform -strict on what helm renders, against the schemas of
#   Kubernetes' own OpenAPI document, and the ServiceMonitor against the Prometheus operator's own CRD. helm and
#   kubeconform are built with `go install`; the schemas are made from k8s.io/kubernetes' api/openapi-spec/swagger.json
#   (Go module proxy) by openapi2jsonschema, the ServiceMonitor's from the CRD in the prometheus-operator module.
# Tools are kept in .tools/ (BLOCKFLOW_TOOLS); a second run only checks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BLOCKFLOW_VENV:-$ROOT/.venv}"
TOOLS="${BLOCKFLOW_TOOLS:-$ROOT/.tools}"
HELM_VERSION=v3.19.5
PROMETHEUS_OPERATOR_VERSION=v0.78.2
KUBECONFORM_VERSION=v0.8.0
K8S_VERSION=1.34.4
CHART="$ROOT/deploy/helm/blockflow"
log() { printf '[deploy-check] %s\n' "$*" >&2; }
mkdir -p "$TOOLS/bin"
# Run a set-up step quietly; its output only if it fails.
quiet() { "$@" >"$TOOLS/step.log" 2>&1 || { cat "$TOOLS/step.log" >&2; log "failed: $*"; exit 1; }; }

if [ ! -x "$TOOLS/bin/helm" ] || [ ! -x "$TOOLS/bin/kubeconform" ]; then
  command -v go >/dev/null || { log "go is needed to build helm and kubeconform (https://go.dev/dl/)"; exit 1; }
  log "building helm $HELM_VERSION and kubeconform $KUBECONFORM_VERSION with go install (first time: a minute or two)"
  export GOBIN="$TOOLS/bin" GOFLAGS=-mod=mod
  quiet go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  quiet go install "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"
fi

SCHEMAS="$TOOLS/k8s-schemas"
if [ ! -f "$SCHEMAS/v$K8S_VERSION-standalone-strict/deployment-apps-v1.json" ]; then
  log "making Kubernetes $K8S_VERSION JSON schemas from its OpenAPI document"
  SPEC_DIR="$(cd "$TOOLS" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  if [ ! -x "$TOOLS/o2j/bin/openapi2jsonschema" ]; then
    # Its metadata pins PyYAML < 6, which no longer builds; it runs on today's PyYAML.
    quiet "$VENV/bin/python" -m venv "$TOOLS/o2j"
    quiet "$TOOLS/o2j/bin/pip" install --no-deps openapi2jsonschema==0.9.1
    quiet "$TOOLS/o2j/bin/pip" install jsonref pyyaml click colorama
  fi
  mkdir -p "$SCHEMAS"
  (cd "$SCHEMAS" && quiet "$TOOLS/o2j/bin/openapi2jsonschema" --expanded --kubernetes --stand-alone --strict \
     -o "v$K8S_VERSION-standalone-strict" "$SPEC_DIR/api/openapi-spec/swagger.json")
fi

CRD_SCHEMAS="$TOOLS/crd-schemas"
if [ ! -f "$CRD_SCHEMAS/monitoring.coreos.com/servicemonitor_v1.json" ]; then
  log "making the ServiceMonitor's JSON schema from prometheus-operator $PROMETHEUS_OPERATOR_VERSION's CRD"
  OP_DIR="$(cd "$TOOLS" && GOFLAGS=-mod=mod go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  mkdir -p "$CRD_SCHEMAS/monitoring.coreos.com"
  # The CRD's openAPIV3Schema, strict as kubeconform's own schemas are: an object with properties takes no others.
  "$VENV/bin/python" - "$OP_DIR/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml" \
      "$CRD_SCHEMAS/monitoring.coreos.com/servicemonitor_v1.json" <<'PY'
import json, sys, yaml
crd = yaml.safe_load(open(sys.argv[1]))
schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
def strict(node):
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
strict(schema)
json.dump(schema, open(sys.argv[2], "w"))
PY
fi

echo "== hadolint (Dockerfile)"
"$VENV/bin/hadolint" --failure-threshold info "$ROOT/Dockerfile"
echo "== helm lint --strict, helm template | kubeconform -strict (deploy/helm/blockflow)"
"$TOOLS/bin/helm" lint --strict "$CHART" >/dev/null
for values in "" "$ROOT"/deploy/helm/ci/*.yaml; do
  "$TOOLS/bin/helm" template blockflow "$CHART" ${values:+-f "$values"} \
    | "$TOOLS/bin/kubeconform" -strict -summary -kubernetes-version "$K8S_VERSION" \
        -schema-location "$SCHEMAS/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
        -schema-location "$CRD_SCHEMAS/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" -
done
