{{- define "sandbox-broker.name" -}}sandbox-broker{{- end -}}

{{- define "sandbox-broker.fullname" -}}
{{- if contains "sandbox-broker" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-sandbox-broker" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sandbox-broker.selectorLabels" -}}
app.kubernetes.io/name: sandbox-broker
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sandbox-broker.labels" -}}
{{ include "sandbox-broker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "sandbox-broker.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "sandbox-broker.runners" -}}
{{- $out := list -}}
{{- range $lang, $img := .Values.runners -}}
{{- $out = append $out (printf "%s=%s" $lang $img) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* A secret value kept across upgrades: the existing one, else a random one. */}}
{{- define "sandbox-broker.secretValue" -}}
{{- $old := lookup "v1" "Secret" .ctx.Release.Namespace (include "sandbox-broker.fullname" .ctx) -}}
{{- if and $old $old.data (hasKey $old.data .key) -}}
{{- index $old.data .key -}}
{{- else if .given -}}
{{- .given | b64enc -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{/* The container security context of every sandbox container (services/kube/podspec.go). */}}
{{- define "sandbox-broker.hardened" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: {{ .Values.sandbox.uid }}
runAsGroup: {{ .Values.sandbox.uid }}
capabilities: {drop: [ALL]}
procMount: Default
{{- end -}}

{{- define "sandbox-broker.hosts" -}}
{{- $svc := include "sandbox-broker.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- $hosts := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- concat $hosts .Values.broker.allowedHosts | join "," -}}
{{- end -}}
