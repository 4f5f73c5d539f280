{{/* Names and labels shared by every object of a release. */}}
{{- define "blockflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "blockflow.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "blockflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "blockflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The plan's text: the value, or the chart's copy of plans/default.yaml. */}}
{{- define "blockflow.plan" -}}
{{- if .Values.plan -}}
{{- .Values.plan -}}
{{- else -}}
{{- .Files.Get "files/plan.yaml" -}}
{{- end -}}
{{- end -}}

{{- define "blockflow.tokenSecret" -}}
{{- .Values.controlToken.existingSecret | default (printf "%s-control" (include "blockflow.fullname" .)) -}}
{{- end -}}

{{- define "blockflow.historyClaim" -}}
{{- .Values.planHistory.existingClaim | default (printf "%s-plans" (include "blockflow.fullname" .)) -}}
{{- end -}}
