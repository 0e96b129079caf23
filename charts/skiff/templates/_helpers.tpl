{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "skiff.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; components append "-gateway", "-worker", ... */}}
{{- define "skiff.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "gateway"). */}}
{{- define "skiff.selectorLabels" -}}
app.kubernetes.io/name: {{ include "skiff.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- /* a model's scope (skiff.models): its labels (none for the first model) */}}
{{- with get .ctx "Model" }}
{{- with .labels }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Recommended labels of one component: (dict "ctx" $ "component" "gateway"). */}}
{{- define "skiff.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "skiff.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: skiff
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* An image block's reference, [registry/]repository:tag[@digest]: the registry is
global.imageRegistry when set, else the block's; the tag defaults to the chart's appVersion. */}}
{{- define "skiff.image" -}}
{{- $registry := .ctx.Values.global.imageRegistry | default .image.registry }}
{{- $ref := printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- if $registry }}{{ $ref = printf "%s/%s" $registry $ref }}{{ end }}
{{- if .image.digest }}{{ $ref = printf "%s@%s" $ref .image.digest }}{{ end }}
{{- $ref }}
{{- end }}

{{- define "skiff.natsUrl" -}}
{{- if .Values.nats.bundled }}
{{- printf "%s://%s-nats:4222" (ternary "tls" "nats" .Values.nats.tls.enabled) (include "skiff.fullname" .) }}
{{- else }}
{{- required "nats.url is required when nats.bundled is false" .Values.nats.url }}
{{- end }}
{{- end }}

{{/* The workers' model directory when model.source is not embedded. */}}
{{- define "skiff.modelDir" -}}
{{- printf "/models/%s" .Values.model.path | trimSuffix "/" }}
{{- end }}

{{/* One name for the gateway's /v1/models, the metric labels and the workers' hello. */}}
{{- define "skiff.servedModelName" -}}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if ne .Values.model.source "embedded" }}
{{- base .Values.model.path }}
{{- else }}
{{- "SmolLM2-135M-Instruct" }}
{{- end }}
{{- end }}

{{/* Environment every service reads (shared/cli_args.py: add_common). */}}
{{- define "skiff.commonEnv" -}}
- name: SKIFF_NATS_URL
  value: {{ include "skiff.natsUrl" . | quote }}
- name: SKIFF_SUBJECT_PREFIX
  value: {{ .Values.subjectPrefix | quote }}
- name: SKIFF_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: SKIFF_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- with .Values.otlpTracesEndpoint }}
- name: SKIFF_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: SKIFF_SERVED_MODEL_NAME
  value: {{ include "skiff.servedModelName" . | quote }}
{{- end }}

{{/* Writable scratch space for a read-only root filesystem: /tmp and /cache. */}}
{{- define "skiff.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{- define "skiff.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}

{{/* Init container: converts the embedded model (worker image) into
/cache/skiff/models/SmolLM2-135M-Instruct, for pods that need its files but not torch. */}}
{{- define "skiff.prepareModel" -}}
- name: prepare-model
  image: {{ include "skiff.image" (dict "ctx" . "image" .Values.worker.image) }}
  imagePullPolicy: {{ .Values.worker.image.pullPolicy }}
  command:
    - python
    - -c
    - from services.worker.gguf_convert import ensure_default_model; ensure_default_model(progress=False)
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- include "skiff.resources" .Values.model.prepare.resources | nindent 4 }}
  volumeMounts:
    {{- include "skiff.scratchVolumeMounts" . | nindent 4 }}
{{- end }}

{{/* NATS users and TLS (values nats.auth, nats.tls). Users: admin, gateway, scheduler and one
per worker pod, named by the pod; their permissions come from shared/nats_auth.py. */}}
{{- define "skiff.natsAuthSecret" -}}
{{- .Values.nats.auth.existingSecret | default (printf "%s-nats-auth" (include "skiff.fullname" .)) }}
{{- end }}

{{/* The Secret of NATS TLS (ca.crt; tls.crt and tls.key for the bundled server):
nats.tls.secretName, else <fullname>-nats-tls, generated by the chart for the bundled server. */}}
{{- define "skiff.natsTlsSecret" -}}
{{- if .Values.nats.tls.secretName }}
{{- .Values.nats.tls.secretName }}
{{- else if .Values.nats.bundled }}
{{- printf "%s-nats-tls" (include "skiff.fullname" .) }}
{{- else }}
{{- fail "nats.tls: an external NATS (nats.bundled=false) needs nats.tls.secretName, a Secret with the CA of its certificate (ca.crt), or nats.tls.enabled=false" }}
{{- end }}
{{- end }}

{{/* The DNS names of the bundled NATS servers, a JSON list: the client Service and, for the
cluster routes, each server's name under the headless Service (a wildcard). */}}
{{- define "skiff.natsDnsNames" -}}
{{- $nats := printf "%s-nats" (include "skiff.fullname" .) }}
{{- $ns := .Release.Namespace }}
{{- $names := list }}
{{- range $svc := list $nats (printf "%s-cluster" $nats) }}
{{- $names = concat $names (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) }}
{{- end }}
{{- $cluster := printf "%s-nats-cluster.%s.svc" (include "skiff.fullname" .) $ns }}
{{- $names = concat $names (list (printf "*.%s" $cluster) (printf "*.%s.cluster.local" $cluster)) }}
{{- toJson $names }}
{{- end }}

{{/* The worker sets of a model (a scope of skiff.models), as a JSON list: the default set
(component "worker", role mixed) and each enabled role set, worker.prefill and worker.decode
(component "worker-prefill" or "worker-decode": a StatefulSet, Service, PDB and ScaledObject of
its own). Each set carries what may differ between sets, an empty override of a role set taking
worker's: component, role, values (its values path), replicas, autoscaling, kvCacheGiB,
resources (worker.sim's for simulated workers), nodeSelector, tolerations, affinity. */}}
{{- define "skiff.workerSets" -}}
{{- $key := .Model.key }}
{{- $w := .Values.worker }}
{{- $sim := eq $w.device "sim" }}
{{- $sets := list (dict "component" "worker" "role" "mixed" "values" (printf "%sworker" $key) "replicas" $w.replicas "autoscaling" $w.autoscaling "kvCacheGiB" $w.kvCacheGiB "resources" (ternary $w.sim.resources $w.resources $sim) "nodeSelector" $w.nodeSelector "tolerations" $w.tolerations "affinity" $w.affinity) }}
{{- range list (list "prefill" .Values.worker.prefill) (list "decode" .Values.worker.decode) }}
{{- $role := index . 0 }}
{{- $set := index . 1 }}
{{- if $set.enabled }}
{{- /* one Prometheus and polling for every ScaledObject of the release */}}
{{- $autoscaling := merge (deepCopy $set.autoscaling) (pick $w.autoscaling "serverAddress" "pollingInterval" "cooldownPeriod") }}
{{- $sets = append $sets (dict "component" (printf "worker-%s" $role) "role" $role "values" (printf "%sworker.%s" $key $role) "replicas" $set.replicas "autoscaling" $autoscaling "kvCacheGiB" ($set.kvCacheGiB | default $w.kvCacheGiB) "resources" ($set.resources | default (ternary $w.sim.resources $w.resources $sim)) "nodeSelector" ($set.nodeSelector | default $w.nodeSelector) "tolerations" ($set.tolerations | default $w.tolerations) "affinity" ($set.affinity | default $w.affinity)) }}
{{- end }}
{{- end }}
{{- toJson $sets }}
{{- end }}

{{/* The NATS users of one worker set's pods, space-separated: <name>-<component>-<ordinal>
(<name>: the model's, skiff.models) for every pod that its replicas (or autoscaling.maxReplicas)
may run: (dict "ctx" $model "set" $set) with $model a scope of skiff.models and $set one of its
skiff.workerSets. */}}
{{- define "skiff.natsSetUsers" -}}
{{- $users := list }}
{{- $a := .set.autoscaling }}
{{- range $i := until (int (ternary $a.maxReplicas .set.replicas $a.enabled)) }}
{{- $users = append $users (printf "%s-%s-%d" $.ctx.Model.name $.set.component $i) }}
{{- end }}
{{- join " " $users }}
{{- end }}

{{/* The NATS users of every worker pod of every set of every model, space-separated. */}}
{{- define "skiff.natsWorkerUsers" -}}
{{- $users := list }}
{{- $models := dict }}
{{- $_ := include "skiff.models" (dict "ctx" . "into" $models) }}
{{- range $model := $models.models }}
{{- range $set := include "skiff.workerSets" $model | fromJsonArray }}
{{- $users = concat $users (compact (splitList " " (include "skiff.natsSetUsers" (dict "ctx" $model "set" $set)))) }}
{{- end }}
{{- end }}
{{- join " " $users }}
{{- end }}

{{/* A service's NATS user and CA: (dict "ctx" $ "user" "gateway"). */}}
{{- define "skiff.natsClientEnv" -}}
{{- if .ctx.Values.nats.authCallout.enabled }}
# the auth callout admits this pod by its service-account token and names its user by the pod
- name: SKIFF_NATS_USER
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: SKIFF_NATS_TOKEN_FILE
  value: /var/run/secrets/skiff/nats/token
{{- else if .ctx.Values.nats.auth.enabled }}
- name: SKIFF_NATS_USER
  value: {{ .user | quote }}
- name: SKIFF_NATS_PASSWORD_FILE
  value: {{ printf "/etc/skiff/nats-auth/%s" .user | quote }}
{{- end }}
{{- if .ctx.Values.nats.tls.enabled }}
- name: SKIFF_NATS_TLS_CA
  value: /etc/skiff/nats-tls/ca.crt
{{- end }}
{{- end }}

{{- define "skiff.natsClientVolumeMounts" -}}
{{- if .Values.nats.authCallout.enabled }}
- name: nats-token
  mountPath: /var/run/secrets/skiff/nats
  readOnly: true
{{- else if .Values.nats.auth.enabled }}
- name: nats-auth
  mountPath: /etc/skiff/nats-auth
  readOnly: true
{{- end }}
{{- if .Values.nats.tls.enabled }}
- name: nats-tls
  mountPath: /etc/skiff/nats-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The password files of `users` only: (dict "ctx" $ "users" (list "gateway")). No users (a
worker set of 0 replicas): an empty volume, since a secret volume without items would hold
every password. */}}
{{- define "skiff.natsClientVolumes" -}}
{{- $callout := .ctx.Values.nats.authCallout }}
{{- if $callout.enabled }}
- name: nats-token  # the kubelet rotates it; the services read it again at each reconnection
  projected:
    sources:
      - serviceAccountToken:
          audience: {{ $callout.audience | quote }}
          expirationSeconds: {{ int $callout.tokenExpirationSeconds }}
          path: token
{{- else if .ctx.Values.nats.auth.enabled }}
- name: nats-auth
  {{- if .users }}
  secret:
    secretName: {{ include "skiff.natsAuthSecret" .ctx }}
    defaultMode: 0440
    items:
      {{- range .users }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- if .ctx.Values.nats.tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ include "skiff.natsTlsSecret" .ctx }}
    items:
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end }}

{{/* The Secret holding the gateway's API key: gateway.apiKeySecret.name, or <fullname>-api-key
when the chart creates it. Empty: no API key. */}}
{{- define "skiff.apiKeySecretName" -}}
{{- $k := .Values.gateway.apiKeySecret }}
{{- if $k.name }}
{{- $k.name }}
{{- else if $k.create }}
{{- printf "%s-api-key" (include "skiff.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret holding the gateway's API key file: gateway.apiKeys.existingSecret, or
<fullname>-api-keys rendered from gateway.apiKeys.tenants. Empty: no key file. */}}
{{- define "skiff.apiKeysSecretName" -}}
{{- $keys := .Values.gateway.apiKeys }}
{{- if and $keys.existingSecret $keys.tenants }}
{{- fail "gateway.apiKeys: set existingSecret or tenants, not both" }}
{{- else if $keys.existingSecret }}
{{- $keys.existingSecret }}
{{- else if $keys.tenants }}
{{- printf "%s-api-keys" (include "skiff.fullname" .) }}
{{- end }}
{{- end }}

{{/* The API key file of gateway.apiKeys.tenants (JSON). */}}
{{- define "skiff.apiKeyFile" -}}
{{- dict "tenants" .Values.gateway.apiKeys.tenants | toJson }}
{{- end }}

{{/* A Kubernetes quantity (16Gi, 500M, 17179869184) in GiB; empty when it is not a plain
number with a binary or decimal suffix. */}}
{{- define "skiff.quantityGiB" -}}
{{- $q := toString . }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $factors := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 }}
{{- $suffix := trimPrefix $num $q }}
{{- if and $num (hasKey $factors $suffix) }}
{{- divf (mulf (float64 $num) (get $factors $suffix)) 1073741824.0 }}
{{- end }}
{{- end }}
