{{/* The workers' model storage (model.source) as a pod volume named "model"; nothing for the
embedded model. */}}
{{- define "skiff.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "existingClaim" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.existingClaim is required when model.source is existingClaim" $m.existingClaim }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "skiff.fullname" . }}-model
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "volume" }}
- name: model
  {{- toYaml $m.volume | nindent 2 }}
{{- end }}
{{- end }}

{{/* Where the gateways' tokenizer files come from: "volume" (gateway.tokenizer.volume),
"image" (the embedded model's, in the gateway image) or "download" (model.download's repo). */}}
{{- define "skiff.tokenizerSource" -}}
{{- if .Values.gateway.tokenizer.volume }}volume
{{- else if eq .Values.model.source "embedded" }}image
{{- else if .Values.model.download.enabled }}download
{{- else }}
{{- fail "gateway.tokenizer.volume is required for a model that is neither embedded nor downloaded (model.download): the gateways do not mount the workers' model storage" }}
{{- end }}
{{- end }}

{{/* Init container that downloads model.download.repo at its revision into `dir` of the
volume `volume` (mounted at `mountPath`), skipped when a marker file in `dir` names the same
repo and revision: (dict "ctx" $ "image" .Values.worker.image "volume" "model"
"mountPath" "/models" "dir" "/models/Qwen3-8B" "include" (list "*.json")). */}}
{{- define "skiff.downloadModel" -}}
{{- $d := .ctx.Values.model.download }}
- name: download-model
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
    - {{ required "model.download.repo is required when model.download.enabled" $d.repo | quote }}
    - {{ required "model.download.revision is required when model.download.enabled" $d.revision | quote }}
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
