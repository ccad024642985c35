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
{{- range $key := list "resource_domain" "device_plugin_dir" "http_listen" }}
{{- if regexMatch (printf "(?m)^\\s*[\"']?%s[\"']?\\s*=" $key) $.Values.config }}
{{- fail (printf "config sets %s: the chart sets it from resourceDomain, kubeletRootDir and metricsPort; set those values instead" $key) }}
{{- end }}
{{- end -}}
{{- if regexMatch "(?m)^\\s*\\[\\s*[\"']?enforcement[\"']?\\s*\\]|^\\s*[\"']?enforcement[\"']?\\s*[.=]" .Values.config }}
{{- fail "config sets [enforcement]: the chart sets it from enforcement.mode, enforcement.libraryDir, enforcement.stateDir, enforcement.compute and enforcement.mps; set those values instead" }}
{{- end -}}
# Set by the chart from resourceDomain, kubeletRootDir and metricsPort.
resource_domain = {{ .Values.resourceDomain | quote }}
device_plugin_dir = {{ include "gpu-device-plugin.devicePluginDir" . | quote }}
http_listen = {{ printf "0.0.0.0:%d" (int .Values.metricsPort) | quote }}
{{ .Values.config }}
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
