{{/* The models the release serves, each as a scope for the per-model templates (scheduler,
workers, their Services, PDBs, ScaledObjects, Leases, model PVC): the first model from the
top-level values, then one per `models` entry. A scope is the release's root (.Release, .Chart,
.Capabilities, ...) whose .Values are that model's, so that templates and helpers read a model's
values as they read the first one's, and .Model: `id` ("" for the first), `name` (the base of
its resource names: <fullname>, or <fullname>-<id>), `labels` (added to its objects' labels and
selectors: none for the first model, whose selectors predate the others; skiff.io/model: <id>
for the others) and `key` (its values' path in messages: "" or "models[<id>].").

A `models` entry's values are the top-level ones but for subjectPrefix
(<subjectPrefix>.models.<id>), worker, scheduler and engine (the entry's merged over the
top-level ones: maps key by key, the entry's winning; lists, null and other values replace),
model (the entry's merged over the top-level model, whose path, servedModelName and
download.enabled, repo and revision it does not inherit: its servedModelName is the entry's,
default the id), gateway.tokenizer (the entry's `tokenizer`) and lora (the entry's merged over
the top-level settings, but off and with no modules unless the entry names them: adapters fit
one model; the entry's volume replaces the top-level one).

Templates return text only: the list comes back in `into`, (dict "ctx" $ "into" $m), then
`range $m.models`. */}}
{{- define "skiff.models" -}}
{{- $root := .ctx }}
{{- /* $top: the top-level values, copied whole (a copy reads no value) */}}
{{- $top := $root.Values }}
{{- $fullname := include "skiff.fullname" $root }}
{{- $models := list (dict "values" $top "model" (dict "id" "" "name" $fullname "labels" dict "key" "")) }}
{{- $ids := list }}
{{- range $entry := .ctx.Values.models }}
{{- if has $entry.id $ids }}
{{- fail (printf "models: the id %q is used twice; each model needs an id of its own" $entry.id) }}
{{- end }}
{{- $ids = append $ids $entry.id }}
{{- $values := dict }}
{{- range $key, $value := $top }}
{{- $_ := set $values $key $value }}
{{- end }}
{{- $_ := set $values "subjectPrefix" (printf "%s.models.%s" $top.subjectPrefix $entry.id) }}
{{- $model := deepCopy $top.model }}
{{- $_ = set $model "path" "" }}
{{- $_ = set $model.download "enabled" false }}
{{- $_ = set $model.download "repo" "" }}
{{- $_ = set $model.download "revision" "" }}
{{- $model = mergeOverwrite $model (deepCopy ($entry.model | default dict)) }}
{{- $_ = set $model "servedModelName" ($entry.servedModelName | default $entry.id) }}
{{- $_ = set $values "model" $model }}
{{- range $key := list "worker" "scheduler" "engine" }}
{{- $_ := set $values $key (mergeOverwrite (deepCopy (get $top $key)) (deepCopy (get $entry $key | default dict))) }}
{{- end }}
{{- $tokenizer := mergeOverwrite (dict "volume" dict "path" "") (deepCopy ($entry.tokenizer | default dict)) }}
{{- $_ = set $values "gateway" (merge (dict "tokenizer" $tokenizer) (omit $top.gateway "tokenizer")) }}
{{- $lora := merge (dict "enabled" false "modules" dict) (deepCopy (omit $top.lora "enabled" "modules")) }}
{{- $entryLora := deepCopy ($entry.lora | default dict) }}
{{- if $entryLora.volume }}
{{- $_ = set $lora "volume" $entryLora.volume }}
{{- end }}
{{- $_ = set $values "lora" (mergeOverwrite $lora (omit $entryLora "volume")) }}
{{- $meta := dict "id" $entry.id "name" (printf "%s-%s" $fullname $entry.id) "labels" (dict (include "skiff.modelLabel" $root) $entry.id) "key" (printf "models[%s]." $entry.id) }}
{{- $models = append $models (dict "values" $values "model" $meta) }}
{{- end }}
{{- $scopes := list }}
{{- range $models }}
{{- $scope := dict "Values" .values "Model" .model }}
{{- range $key, $value := $root }}
{{- if ne $key "Values" }}
{{- $_ := set $scope $key $value }}
{{- end }}
{{- end }}
{{- $scopes = append $scopes $scope }}
{{- end }}
{{- $_ := set .into "models" $scopes }}
{{- end }}

{{/* The label of a `models` entry's objects and pods (skiff.models), its value the id. */}}
{{- define "skiff.modelLabel" -}}
skiff.io/model
{{- end }}

{{/* A ServiceMonitor endpoint's relabeling for a release of several models: the first model's
Services (whose selectors predate `models`) select the other models' pods too, which carry
skiff.modelLabel besides; each pod is scraped through its own model's Service only. */}}
{{- define "skiff.ownModelTargets" -}}
{{- $label := include "skiff.modelLabel" . | replace "." "_" | replace "/" "_" }}
- action: drop
  sourceLabels: [__meta_kubernetes_service_label_{{ $label }}, __meta_kubernetes_pod_label_{{ $label }}]
  regex: ";.+"
{{- end }}
