{{/* One name for every object, the label kustomize's tree carries too. */}}
{{- define "gpu-device-plugin.name" -}}
{{ .Chart.Name }}
{{- end }}

{{- define "gpu-device-plugin.labels" -}}
app.kubernetes.io/name: {{ include "gpu-device-plugin.name" . }}
{{- end }}

{{- define "gpu-device-plugin.serviceAccountUser" -}}
system:serviceaccount:{{ .Values.namespace }}:{{ include "gpu-device-plugin.name" . }}
{{- end }}

{{- define "gpu-device-plugin.devicePluginDir" -}}
{{ trimSuffix "/" .Values.kubeletRootDir }}/device-plugins
{{- end }}

{{/*
The daemon's TOML: the keys other objects depend on come from the values
(the hostPath mount, the admission policy's annotation prefix, the port),
then the user's config, which must not set them again.
*/}}
{{- define "gpu-device-plugin.config" -}}
{{- range $key := list "resource_domain" "device_plugin_dir" "http_listen" "resources" "pod_matching" }}
{{- if regexMatch (printf "(?m)^\\s*[\"']?%s[\"']?\\s*=" $key) $.Values.config }}
{{- fail (printf "config sets %s: the chart sets it from resourceDomain, kubeletRootDir, metricsPort and devicePlugin; set those values instead" $key) }}
{{- end }}
{{- end -}}
{{- if regexMatch "(?m)^\\s*\\[\\s*[\"']?enforcement[\"']?\\s*\\]|^\\s*[\"']?enforcement[\"']?\\s*[.=]" .Values.config }}
{{- fail "config sets [enforcement]: the chart sets it from enforcement.mode, enforcement.libraryDir, enforcement.stateDir, enforcement.compute and enforcement.mps; set those values instead" }}
{{- end -}}
{{- if regexMatch "(?m)^\\s*\\[\\s*[\"']?usage[\"']?\\s*\\]|^\\s*[\"']?usage[\"']?\\s*[.=]" .Values.config }}
{{- fail "config sets [usage]: the chart sets it from usage.pollMs (and mounts the host's /proc where proc_root says); set that value instead" }}
{{- end -}}
{{- if regexMatch "(?m)^\\s*\\[\\s*[\"']?dra[\"']?\\s*\\]|^\\s*[\"']?dra[\"']?\\s*[.=]" .Values.config }}
{{- fail "config sets [dra]: the chart sets it from dra.*, kubeletRootDir and enforcement.stateDir; set those values instead" }}
{{- end -}}
{{- if and (has "all" .Values.dra.gpus) (gt (len .Values.dra.gpus) 1) }}
{{- fail "dra.gpus lists \"all\" beside other GPUs; use [\"all\"] alone" }}
{{- end -}}
# Set by the chart from resourceDomain, kubeletRootDir and metricsPort.
resource_domain = {{ .Values.resourceDomain | quote }}
device_plugin_dir = {{ include "gpu-device-plugin.devicePluginDir" . | quote }}
http_listen = {{ printf "0.0.0.0:%d" (int .Values.metricsPort) | quote }}
{{- if include "gpu-device-plugin.draAll" . }}
# DRA serves every GPU (see [dra]): no device-plugin resources, no Allocate
# to match.
resources = []
pod_matching = false
{{- else }}
# Set by the chart from devicePlugin.
resources = {{ .Values.devicePlugin.resources | toJson }}
pod_matching = {{ .Values.devicePlugin.podMatching }}
{{- end }}
{{ .Values.config }}
# Set by the chart from usage.pollMs; the DaemonSet mounts the host's /proc
# at proc_root.
[usage]
poll_ms = {{ int .Values.usage.pollMs }}
proc_root = "/host/proc"
# Set by the chart from enforcement.*.
[enforcement]
mode = {{ .Values.enforcement.mode | quote }}
library_dir = {{ .Values.enforcement.libraryDir | quote }}
state_dir = {{ .Values.enforcement.stateDir | quote }}
{{- with .Values.enforcement.compute }}
compute = {{ . | quote }}
{{- end }}
{{- if include "gpu-device-plugin.mps" . }}
[enforcement.mps]
pipe_dir = {{ .Values.enforcement.mps.pipeDir | quote }}
log_dir = {{ .Values.enforcement.mps.logDir | quote }}
shm_dir = {{ .Values.enforcement.mps.shmDir | quote }}
{{- end }}
{{- if .Values.dra.enabled }}
# Set by the chart from dra.*, kubeletRootDir and enforcement.stateDir.
[dra]
enabled = true
{{- with .Values.dra.driver }}
driver = {{ . | quote }}
{{- end }}
gpus = {{ .Values.dra.gpus | toJson }}
consumable_capacity = {{ .Values.dra.consumableCapacity }}
plugins_registry_dir = {{ include "gpu-device-plugin.pluginsRegistryDir" . | quote }}
plugins_dir = {{ include "gpu-device-plugin.pluginsDir" . | quote }}
cdi_dir = {{ .Values.dra.cdiDir | quote }}
state_dir = {{ include "gpu-device-plugin.draStateDir" . | quote }}
{{- end }}
{{- end }}

{{/* DRA serves every GPU: no device-plugin resources, DRA's rights alone. */}}
{{- define "gpu-device-plugin.draAll" -}}
{{- if and .Values.dra.enabled (has "all" .Values.dra.gpus) }}true{{ end }}
{{- end }}

{{- define "gpu-device-plugin.draDriver" -}}
{{ .Values.dra.driver | default (printf "gpu.%s" .Values.resourceDomain) }}
{{- end }}

{{- define "gpu-device-plugin.pluginsRegistryDir" -}}
{{ trimSuffix "/" .Values.kubeletRootDir }}/plugins_registry
{{- end }}

{{- define "gpu-device-plugin.pluginsDir" -}}
{{ trimSuffix "/" .Values.kubeletRootDir }}/plugins
{{- end }}

{{- define "gpu-device-plugin.draStateDir" -}}
{{ .Values.enforcement.stateDir }}/dra
{{- end }}

{{/* Whether the DaemonSet mounts enforcement.stateDir: enforcement's
state, and DRA's checkpoint below it. */}}
{{- define "gpu-device-plugin.stateful" -}}
{{- if or (include "gpu-device-plugin.enforcing" .) .Values.dra.enabled }}true{{ end }}
{{- end }}

{{/* Whether the daemon runs MPS control daemons (their host directories). */}}
{{- define "gpu-device-plugin.mps" -}}
{{- if eq .Values.enforcement.compute "mps" }}true{{ end }}
{{- end }}

{{/* Whether the DaemonSet mounts the enforcement host directories. */}}
{{- define "gpu-device-plugin.enforcing" -}}
{{- if eq .Values.enforcement.mode "hami-core" }}true{{ end }}
{{- end }}

{{/* The GPU scheduler's objects: its name is their name and label. */}}
{{- define "gpu-device-plugin.scheduler.labels" -}}
app.kubernetes.io/name: {{ .Values.extender.schedulerName }}
{{- end }}

{{/*
The extender's TOML: listen and resource_domain come from the values (the
scheduler's urlPrefix and managedResources must agree with them), then the
user's keys of the same table, which must not set them again.
*/}}
{{- define "gpu-device-plugin.scheduler.extenderConfig" -}}
{{- range $key := list "listen" "resource_domain" }}
{{- if regexMatch (printf "(?m)^\\s*[\"']?%s[\"']?\\s*=" $key) $.Values.extender.config }}
{{- fail (printf "extender.config sets %s: the chart sets it from extender.port and resourceDomain; set those values instead" $key) }}
{{- end }}
{{- end -}}
{{- if regexMatch "(?m)^\\s*\\[" .Values.extender.config }}
{{- fail "extender.config has a table header: it is the body of the [extender] table, keys only" }}
{{- end -}}
[extender]
# Set by the chart from extender.port and resourceDomain.
listen = {{ printf "127.0.0.1:%d" (int .Values.extender.port) | quote }}
resource_domain = {{ .Values.resourceDomain | quote }}
{{ .Values.extender.config }}
{{- end }}

{{- define "gpu-device-plugin.scheduler.serviceAccountUser" -}}
system:serviceaccount:{{ .Values.extender.namespace }}:{{ .Values.extender.schedulerName }}
{{- end }}

{{/* Usage is read (and the host's /proc mounted): with pod matching or
DRA, which name a process's container, and a poll. */}}
{{- define "gpu-device-plugin.readsUsage" -}}
{{- if and (or .Values.devicePlugin.podMatching .Values.dra.enabled) (gt (int .Values.usage.pollMs) 0) }}true{{- end }}
{{- end }}
