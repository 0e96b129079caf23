{{/* Pod-level escape hatches shared by the gateway, scheduler and worker workloads. Each takes
(dict "ctx" $ "component" "gateway" "v" $g) with $g the component's values; podMetadata
also takes "extraLabels". */}}

{{/* Pod template labels: the selector labels and part-of only, never helm.sh/chart or the app
version, so that a chart-only upgrade does not roll the pods; then the user's podLabels. */}}
{{- define "skiff.podMetadata" -}}
labels:
  {{- include "skiff.selectorLabels" . | nindent 2 }}
  app.kubernetes.io/part-of: skiff
  {{- with .extraLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with .v.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .v.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The component's ServiceAccount: its own when serviceAccount.create (named
serviceAccount.name or <fullname>-<component>), else serviceAccount.name, else "default". */}}
{{- define "skiff.serviceAccountName" -}}
{{- if .v.serviceAccount.create }}
{{- .v.serviceAccount.name | default (printf "%s-%s" (include "skiff.fullname" .ctx) .component) }}
{{- else }}
{{- .v.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}

{{/* Pod spec fields: serviceAccountName, priorityClassName, topologySpreadConstraints. */}}
{{- define "skiff.podExtras" -}}
serviceAccountName: {{ include "skiff.serviceAccountName" . }}
{{- with .v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- include "skiff.topologySpreadConstraints" (dict "ctx" $.ctx "constraints" .) | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container envFrom (after the chart's env, which extraEnv entries follow). */}}
{{- define "skiff.envFrom" -}}
{{- with .v.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
