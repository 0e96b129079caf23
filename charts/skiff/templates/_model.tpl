{{/* A model's (a scope of skiff.models) worker storage (model.source) as a pod volume named
"model"; nothing for the embedded model. */}}
{{- define "skiff.modelVolume" -}}
{{- $m := .Values.model }}
{{- $key := .Model.key }}
{{- if eq $m.source "existingClaim" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required (printf "%smodel.existingClaim is required when model.source is existingClaim" $key) $m.existingClaim }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Model.name }}-model
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required (printf "%smodel.hostPath.path is required when model.source is hostPath" $key) $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "volume" }}
- name: model
  {{- toYaml (required (printf "%smodel.volume is required when model.source is volume" $key) ($m.volume | default nil)) | nindent 2 }}
{{- end }}
{{- end }}

{{/* Where the gateways' tokenizer files of a model (a scope of skiff.models) come from:
"volume" (gateway.tokenizer.volume; a `models` entry's `tokenizer`), "image" (the embedded
model's, in the gateway image) or "download" (model.download's repo). */}}
{{- define "skiff.tokenizerSource" -}}
{{- if .Values.gateway.tokenizer.volume }}volume
{{- else if eq .Values.model.source "embedded" }}image
{{- else if .Values.model.download.enabled }}download
{{- else }}
{{- $where := ternary "gateway.tokenizer" (printf "%stokenizer" .Model.key) (not .Model.id) }}
{{- fail (printf "%s.volume is required for a model that is neither embedded nor downloaded (%smodel.download): the gateways do not mount the workers' model storage" $where .Model.key) }}
{{- end }}
{{- end }}

{{/* Init container (named `name`, default download-model) that downloads model.download.repo
at its revision into `dir` of the volume `volume` (mounted at `mountPath`), skipped when a
marker file in `dir` names the same repo and revision: (dict "ctx" $model "image"
.Values.worker.image "volume" "model" "mountPath" "/models" "dir" "/models/Qwen3-8B" "include"
(list "*.json")) with $model a scope of skiff.models. */}}
{{- define "skiff.downloadModel" -}}
{{- $d := .ctx.Values.model.download }}
{{- $key := .ctx.Model.key }}
- name: {{ .name | default "download-model" }}
  image: {{ include "skiff.image" (dict "ctx" .ctx "image" .image) }}
  imagePullPolicy: {{ .image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import sys
      from pathlib import Path
      from huggingface_hub import snapshot_download
      repo, revision, local_dir, *include = sys.argv[1:]
      marker, done = Path(local_dir) / ".skiff-download", f"{repo}@{revision}\n"
      if marker.is_file() and marker.read_text() == done:
          print(f"{local_dir}: {repo}@{revision} is there")
      else:
          snapshot_download(repo, revision=revision, local_dir=local_dir, allow_patterns=include)
          marker.write_text(done)
    - {{ required (printf "%smodel.download.repo is required when model.download.enabled" $key) $d.repo | quote }}
    - {{ required (printf "%smodel.download.revision is required when model.download.enabled" $key) $d.revision | quote }}
    - {{ .dir | quote }}
    {{- range .include }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HF_HOME
      value: /cache/huggingface
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- with $d.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- if $d.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $d.tokenSecret.name }}
          key: {{ $d.tokenSecret.key }}
    {{- end }}
  securityContext:
    {{- toYaml .ctx.Values.securityContext | nindent 4 }}
  resources:
    {{- include "skiff.resources" $d.resources | nindent 4 }}
  volumeMounts:
    {{- include "skiff.scratchVolumeMounts" .ctx | nindent 4 }}
    - name: {{ .volume }}
      mountPath: {{ .mountPath }}
{{- end }}

{{/* The scheduler's --lora-modules: "name=/adapters/dir ..." of lora.modules, sorted. */}}
{{- define "skiff.loraModules" -}}
{{- $items := list }}
{{- range $name := keys .Values.lora.modules | sortAlpha }}
{{- $items = append $items (printf "%s=/adapters/%s" $name (trimPrefix "/" (get $.Values.lora.modules $name))) }}
{{- end }}
{{- join " " $items }}
{{- end }}
