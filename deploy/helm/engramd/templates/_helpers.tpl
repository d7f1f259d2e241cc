{{/* The labels every object of the release carries. */}}
{{- define "engramd.labels" -}}
app.kubernetes.io/name: engramd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{/* What the DaemonSet selects its pods by (and the Service its endpoints by). */}}
{{- define "engramd.selector" -}}
app.kubernetes.io/name: engramd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
