{{/*
Names. Every object is named "<base>-<part>"; the base is shortened with a hash when
the release or override is long, so the longest derived name (KubeRay's worker pods,
"<base>-decode-worker-xxxxx") stays a valid DNS label.
*/}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.base" -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else -}}
{{- $name := include "tandem.name" . -}}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) -}}
{{- end -}}
{{- if gt (len $full) 30 -}}
{{- printf "%s-%s" ($full | trunc 21 | trimSuffix "-") ($full | sha256sum | trunc 8) -}}
{{- else -}}
{{- $full -}}
{{- end -}}
{{- end -}}

{{/* A label value: at most 63 characters (a hash keeps long values distinct). */}}
{{- define "tandem.labelValue" -}}
{{- if gt (len .) 63 -}}
{{- printf "%s-%s" (. | trunc 54 | trimSuffix "-" | trimSuffix "." | trimSuffix "_") (. | sha256sum | trunc 8) -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ include "tandem.labelValue" .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
tandem.ai/model: {{ include "tandem.labelValue" .Values.model.name | quote }}
{{- end -}}

{{- define "tandem.rayCluster" -}}{{ include "tandem.base" . }}{{- end -}}
{{- define "tandem.router" -}}{{ include "tandem.base" . }}-router{{- end -}}
{{/* KubeRay's head Service: "<raycluster>-head-svc". */}}
{{- define "tandem.headService" -}}
{{- printf "%s-head-svc.%s.svc.cluster.local" (include "tandem.rayCluster" .) .Release.Namespace -}}
{{- end -}}

{{- define "tandem.usesGpu" -}}
{{- if gt (int .Values.prefill.gpus) 0 -}}true{{- end -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "-cuda" "" (eq (include "tandem.usesGpu" .) "true"))) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "tandem.modelDir" -}}
{{- printf "%s/%s" .Values.model.mountPath .Values.model.name -}}
{{- end -}}

{{/*
Checks the schema cannot express; each failure names the field.
*/}}
{{- define "tandem.validate" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $pool := index $.Values $role -}}
{{- if gt (int $pool.minReplicas) (int $pool.maxReplicas) -}}
{{- fail (printf "%s.minReplicas (%d) must be <= %s.maxReplicas (%d)" $role (int $pool.minReplicas) $role (int $pool.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $pool.replicas) (int $pool.minReplicas)) (gt (int $pool.replicas) (int $pool.maxReplicas)) -}}
{{- fail (printf "%s.replicas (%d) must be within [%s.minReplicas, %s.maxReplicas] = [%d, %d]" $role (int $pool.replicas) $role $role (int $pool.minReplicas) (int $pool.maxReplicas)) -}}
{{- end -}}
{{- $gpuEntry := index $pool.resources "nvidia.com/gpu" -}}
{{- if and (hasKey $pool.resources "nvidia.com/gpu") (ne (toString $gpuEntry) (toString $pool.gpus)) -}}
{{- fail (printf "%s.resources[\"nvidia.com/gpu\"] (%v) disagrees with %s.gpus (%v): a pod's GPUs come from %s.gpus alone; drop the resources entry" $role $gpuEntry $role $pool.gpus $role) -}}
{{- end -}}
{{- end -}}
{{- if ne (int .Values.prefill.gpus) (int .Values.decode.gpus) -}}
{{- fail (printf "prefill.gpus (%v) and decode.gpus (%v) must be equal: both pools run on the same device kind" .Values.prefill.gpus .Values.decode.gpus) -}}
{{- end -}}
{{- if ne (toJson (.Values.prefill.engineArgs | default dict)) (toJson (.Values.decode.engineArgs | default dict)) -}}
{{- fail "prefill.engineArgs and decode.engineArgs must be equal: `tandem serve` runs one engine configuration for both pools" -}}
{{- end -}}
{{- if and (eq .Values.model.source "download") (not .Values.model.download.repo) -}}
{{- fail "model.download.repo is required when model.source is download" -}}
{{- end -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) -}}
{{- fail "model.pvc.claimName is required when model.source is pvc" -}}
{{- end -}}
{{- if and (eq (default "tcp" .Values.prefill.engineArgs.kvBackend) "nccl") (eq (int .Values.prefill.gpus) 0) -}}
{{- fail "prefill.engineArgs.kvBackend nccl needs gpus: 1 (use tcp on CPU)" -}}
{{- end -}}
{{- if and (ne .Values.planner.mode "off") (lt (int .Values.planner.maxWorkers) (add (int .Values.prefill.replicas) (int .Values.decode.replicas) | int)) -}}
{{- fail (printf "planner.maxWorkers (%d) must be >= prefill.replicas + decode.replicas (the workers the pools start with)" (int .Values.planner.maxWorkers)) -}}
{{- end -}}
{{- $perRole := max (int .Values.prefill.maxReplicas) (int .Values.decode.maxReplicas) -}}
{{- if and (ne .Values.planner.mode "off") (gt (int .Values.planner.maxWorkers) (mul 2 $perRole | int)) -}}
{{- fail (printf "planner.maxWorkers (%d) must be <= twice the larger maxReplicas (%d): no split of it fits the worker groups" (int .Values.planner.maxWorkers) $perRole) -}}
{{- end -}}
{{- if has (int .Values.metrics.poolControllerPort) (list 6379 8265 10001) -}}
{{- fail (printf "metrics.poolControllerPort (%d) is one of the Ray head's ports (6379 GCS, 8265 dashboard, 10001 client)" (int .Values.metrics.poolControllerPort)) -}}
{{- end -}}
{{- with .Values.model.pvc.subPath -}}
{{- if or (hasPrefix "/" .) (has ".." (splitList "/" .)) -}}
{{- fail (printf "model.pvc.subPath (%s) must be a relative path without '..' (Kubernetes refuses it)" .) -}}
{{- end -}}
{{- end -}}
{{- if eq (int .Values.router.service.grpcPort) (int .Values.router.service.httpPort) -}}
{{- fail (printf "router.service.grpcPort and httpPort must differ (both %d)" (int .Values.router.service.httpPort)) -}}
{{- end -}}
{{- end -}}

{{/* Volumes and mounts for the model, and the download init container. */}}
{{- define "tandem.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit | default "50Gi" }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
  readOnly: {{ ne .Values.model.source "download" }}
{{- end -}}

{{- define "tandem.initContainers" -}}
{{- if eq .Values.model.source "download" }}
initContainers:
  - name: model-download
    image: {{ include "tandem.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["python", "-c"]
    args:
      - |
        import os
        from huggingface_hub import snapshot_download
        snapshot_download(repo_id=os.environ["MODEL_REPO"], revision=os.environ["MODEL_REVISION"],
                          local_dir=os.environ["MODEL_DIR"], token=os.environ.get("HF_TOKEN") or None)
    env:
      - name: MODEL_REPO
        value: {{ .Values.model.download.repo | quote }}
      - name: MODEL_REVISION
        value: {{ .Values.model.download.revision | quote }}
      - name: MODEL_DIR
        value: {{ include "tandem.modelDir" . | quote }}
      {{- with .Values.model.download.tokenSecret }}
      {{- if .name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ .name }}
            key: {{ .key }}
      {{- end }}
      {{- end }}
    securityContext:
      {{- include "tandem.containerSecurity" . | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- end -}}

{{- define "tandem.podSecurity" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tandem.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Env every Tandem process shares: the secrets it may need. */}}
{{- define "tandem.authEnv" -}}
{{- with .Values.auth.clusterTokenSecret }}
{{- if .name }}
- name: TANDEM_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- with .Values.auth.apiKeySecret }}
{{- if .name }}
- name: TANDEM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end -}}

{{/* CPU/memory (and GPUs from `gpus` alone) as requests = limits. */}}
{{- define "tandem.resources" -}}
{{- $gpus := int (default 0 .gpus) -}}
requests:
  cpu: {{ .resources.cpu | quote }}
  memory: {{ .resources.memory | quote }}
  {{- if gt $gpus 0 }}
  nvidia.com/gpu: {{ $gpus }}
  {{- end }}
limits:
  cpu: {{ .resources.cpu | quote }}
  memory: {{ .resources.memory | quote }}
  {{- if gt $gpus 0 }}
  nvidia.com/gpu: {{ $gpus }}
  {{- end }}
{{- end -}}

{{/* An integer as a flag's text: values files give numbers as floats, which toString
writes as 1e+06 from a million on. */}}
{{- define "tandem.int" -}}
{{- printf "%d" (int64 .) -}}
{{- end -}}

{{/* `tandem serve` flags from the values (the head runs the pool controller). */}}
{{- define "tandem.serveArgs" -}}
{{- $e := .Values.prefill.engineArgs | default dict -}}
{{- $args := list "--ray-address" "auto" "--model" (include "tandem.modelDir" .) -}}
{{- $args = concat $args (list "--prefill" (include "tandem.int" .Values.prefill.replicas) "--decode" (include "tandem.int" .Values.decode.replicas)) -}}
{{- $args = concat $args (list "--max-workers-per-role" (include "tandem.int" (max (int64 .Values.prefill.maxReplicas) (int64 .Values.decode.maxReplicas)))) -}}
{{- $args = concat $args (list "--autoscaling" "--pool-metrics-port" (include "tandem.int" .Values.metrics.poolControllerPort)) -}}
{{- $args = concat $args (list "--restart-backoff" (toString .Values.ray.head.workerRestartBackoffSeconds)) -}}
{{- $args = concat $args (list "--device" (ternary "cuda" "cpu" (eq (include "tandem.usesGpu" .) "true"))) -}}
{{- if $e.kvBackend }}{{ $args = concat $args (list "--kv-backend" $e.kvBackend) }}{{ end -}}
{{- if $e.maxModelLen }}{{ $args = concat $args (list "--max-model-len" (include "tandem.int" $e.maxModelLen)) }}{{ end -}}
{{- if $e.maxNumBatchedTokens }}{{ $args = concat $args (list "--max-num-batched-tokens" (include "tandem.int" $e.maxNumBatchedTokens)) }}{{ end -}}
{{- if $e.kvCacheMemory }}{{ $args = concat $args (list "--kv-cache-memory" $e.kvCacheMemory) }}{{ end -}}
{{- if $e.threads }}{{ $args = concat $args (list "--threads" (include "tandem.int" $e.threads)) }}{{ end -}}
{{- if and (hasKey $e "chunkedPrefill") (not $e.chunkedPrefill) }}{{ $args = append $args "--no-chunked-prefill" }}{{ end -}}
{{- if $e.dtype }}{{ $args = concat $args (list "--dtype" $e.dtype) }}{{ end -}}
{{- if $e.attentionBackend }}{{ $args = concat $args (list "--attention-backend" $e.attentionBackend) }}{{ end -}}
{{- if $e.cudaGraphs }}{{ $args = concat $args (list "--cuda-graphs" $e.cudaGraphs) }}{{ end -}}
{{- if $e.stepWatchdogSeconds }}{{ $args = concat $args (list "--step-watchdog" (toString $e.stepWatchdogSeconds)) }}{{ end -}}
{{- if hasKey $e "maxLocalPrefillTokens" }}{{ $args = concat $args (list "--max-local-prefill-tokens" (include "tandem.int" $e.maxLocalPrefillTokens)) }}{{ end -}}
{{- $args = concat $args (list "--generation-config" .Values.router.generationConfig) -}}
{{- with .Values.router.slo -}}
{{- if .admission }}{{ $args = concat $args (list "--admission" .admission) }}{{ end -}}
{{- if .ttftSeconds }}{{ $args = concat $args (list "--ttft-slo" (toString .ttftSeconds)) }}{{ end -}}
{{- if .itlSeconds }}{{ $args = concat $args (list "--itl-slo" (toString .itlSeconds)) }}{{ end -}}
{{- end -}}
{{- /* Always named: `tandem serve`'s own default is observe. */ -}}
{{- $args = concat $args (list "--planner" .Values.planner.mode) -}}
{{- if ne .Values.planner.mode "off" -}}
{{- $args = concat $args (list "--planner-interval" (toString .Values.planner.interval) "--max-workers" (include "tandem.int" .Values.planner.maxWorkers)) -}}
{{- end -}}
{{- join " " $args -}}
{{- end -}}
