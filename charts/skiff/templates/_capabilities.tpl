{{/* API versions and fields by what the cluster serves (Kubernetes >= 1.20): each API version
is the one of .Capabilities.APIVersions (a cluster's own list, or helm template's
--api-versions), else the one of .Capabilities.KubeVersion (helm template's --kube-version);
fields newer than the server's version are left out, since helm's schema check refuses them. */}}

{{/* PodDisruptionBudget: policy/v1 from 1.21, policy/v1beta1 before. */}}
{{- define "skiff.pdbApiVersion" -}}
{{- if or (.Capabilities.APIVersions.Has "policy/v1/PodDisruptionBudget") (semverCompare ">=1.21-0" .Capabilities.KubeVersion.Version) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end }}
{{- end }}

{{/* HorizontalPodAutoscaler: autoscaling/v2 from 1.23, autoscaling/v2beta2 before (the same
spec for a CPU utilization target). */}}
{{- define "skiff.hpaApiVersion" -}}
{{- if or (.Capabilities.APIVersions.Has "autoscaling/v2/HorizontalPodAutoscaler") (semverCompare ">=1.23-0" .Capabilities.KubeVersion.Version) -}}
autoscaling/v2
{{- else -}}
autoscaling/v2beta2
{{- end }}
{{- end }}

{{/* "true" when the server's Kubernetes is at least `version`: (dict "ctx" $ "version" "1.24"). */}}
{{- define "skiff.kubeAtLeast" -}}
{{- if semverCompare (printf ">=%s-0" .version) .ctx.Capabilities.KubeVersion.Version }}true{{ end }}
{{- end }}

{{/* topologySpreadConstraints without the fields the server does not know: minDomains (1.24),
nodeAffinityPolicy, nodeTaintsPolicy and matchLabelKeys (1.25). */}}
{{- define "skiff.topologySpreadConstraints" -}}
{{- $newer := list }}
{{- if not (include "skiff.kubeAtLeast" (dict "ctx" .ctx "version" "1.24")) }}
{{- $newer = append $newer "minDomains" }}
{{- end }}
{{- if not (include "skiff.kubeAtLeast" (dict "ctx" .ctx "version" "1.25")) }}
{{- $newer = concat $newer (list "nodeAffinityPolicy" "nodeTaintsPolicy" "matchLabelKeys") }}
{{- end }}
{{- range .constraints }}
{{- $known := dict }}
{{- range $field, $value := . }}
{{- if not (has $field $newer) }}
{{- $_ := set $known $field $value }}
{{- end }}
{{- end }}
- {{- toYaml $known | nindent 2 }}
{{- end }}
{{- end }}

{{/* The custom resources that enabled features need and the cluster does not serve, as a JSON
list of [CRD kind, apiVersion/Kind, the value that enables it]. */}}
{{- define "skiff.missingCRDs" -}}
{{- $v := .Values }}
{{- $has := .Capabilities.APIVersions }}
{{- $missing := list }}
{{- if and $v.metrics.serviceMonitor.enabled (not ($has.Has "monitoring.coreos.com/v1/ServiceMonitor")) }}
{{- $missing = append $missing (list "ServiceMonitor (prometheus-operator)" "monitoring.coreos.com/v1/ServiceMonitor" "metrics.serviceMonitor.enabled") }}
{{- end }}
{{- if and $v.metrics.prometheusRule.enabled (not ($has.Has "monitoring.coreos.com/v1/PrometheusRule")) }}
{{- $missing = append $missing (list "PrometheusRule (prometheus-operator)" "monitoring.coreos.com/v1/PrometheusRule" "metrics.prometheusRule.enabled") }}
{{- end }}
{{- $models := dict }}
{{- $_ := include "skiff.models" (dict "ctx" . "into" $models) }}
{{- range $model := $models.models }}
{{- range include "skiff.workerSets" $model | fromJsonArray }}
{{- if and .autoscaling.enabled (not ($has.Has "keda.sh/v1alpha1/ScaledObject")) }}
{{- $missing = append $missing (list "ScaledObject (KEDA)" "keda.sh/v1alpha1/ScaledObject" (printf "%s.autoscaling.enabled" .values)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $v.gateway.httpRoute.enabled (not (include "skiff.httpRouteApiVersion" .)) }}
{{- $missing = append $missing (list "HTTPRoute (Gateway API)" "gateway.networking.k8s.io/v1/HTTPRoute" "gateway.httpRoute.enabled") }}
{{- end }}
{{- toJson $missing }}
{{- end }}

{{/* HTTPRoute: gateway.networking.k8s.io/v1 (Gateway API >= 1.0), else v1beta1; empty when
neither is served. */}}
{{- define "skiff.httpRouteApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "gateway.networking.k8s.io/v1/HTTPRoute" -}}
gateway.networking.k8s.io/v1
{{- else if .Capabilities.APIVersions.Has "gateway.networking.k8s.io/v1beta1/HTTPRoute" -}}
gateway.networking.k8s.io/v1beta1
{{- end }}
{{- end }}

{{/* "true" when helm renders against a cluster (install, upgrade, server dry-run): lookup then
finds the release's namespace; under helm template it returns nothing. */}}
{{- define "skiff.connected" -}}
{{- if lookup "v1" "Namespace" "" .Release.Namespace }}true{{ end }}
{{- end }}

{{/* "true" when some node has allocatable nvidia.com/gpu (read only when connected). */}}
{{- define "skiff.gpuNodes" -}}
{{- range (lookup "v1" "Node" "" "").items | default list }}
{{- if gt (int (index (.status.allocatable | default dict) "nvidia.com/gpu" | default "0")) 0 }}true{{ end }}
{{- end }}
{{- end }}

{{/* Container resources with every quantity a string: server-side apply on 1.20 refuses a
number (e.g. nvidia.com/gpu: 1) where its schema has a Quantity. */}}
{{- define "skiff.resources" -}}
{{- $out := dict }}
{{- range $section, $quantities := . }}
{{- if kindIs "map" $quantities }}
{{- $strings := dict }}
{{- range $name, $q := $quantities }}
{{- if and (kindIs "float64" $q) (eq (float64 (int64 $q)) $q) }}
{{- $q = int64 $q }}
{{- end }}
{{- $_ := set $strings $name (toString $q) }}
{{- end }}
{{- $_ := set $out $section $strings }}
{{- else }}
{{- $_ := set $out $section $quantities }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}
