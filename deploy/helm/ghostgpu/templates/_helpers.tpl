{{/*
Names, labels and the checks every render makes. Every object name and every cross reference (the
tracers' --collector target, the certificates' dnsNames, the monitors' serverName, the Secrets the pods
mount) goes through these, so a release of another name or namespace stays consistent.
*/}}

{{/* The chart's name, overridable (nameOverride) for the app.kubernetes.io/name label. */}}
{{- define "ghostgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object: the release name when it already contains the chart's (a release named
ghostgpu keeps the plain manifests' names: ghostgpu-collector, ghostgpu-tracer, ghostgpu-ca), else
RELEASE-ghostgpu. 40 characters at most: the longest suffix is "-collector-headless" (19), and a
Service name is a DNS label (63).
*/}}
{{- define "ghostgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ghostgpu.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* What selects a component's pods: name, instance and component (never the version: a selector is immutable). */}}
{{- define "ghostgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ghostgpu.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The standard labels of every object: the selector labels plus the chart, version and manager. */}}
{{- define "ghostgpu.labels" -}}
helm.sh/chart: {{ include "ghostgpu.chart" .root }}
{{ include "ghostgpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{- define "ghostgpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ghostgpu.collectorName" -}}{{ include "ghostgpu.fullname" . }}-collector{{- end -}}
{{- define "ghostgpu.collectorHeadlessName" -}}{{ include "ghostgpu.fullname" . }}-collector-headless{{- end -}}
{{- define "ghostgpu.tracerName" -}}{{ include "ghostgpu.fullname" . }}-tracer{{- end -}}
{{- define "ghostgpu.tracerMetricsName" -}}{{ include "ghostgpu.fullname" . }}-tracer-metrics{{- end -}}
{{- define "ghostgpu.policyName" -}}
{{- default (printf "%s-policy" (include "ghostgpu.fullname" .)) .Values.policy.existingConfigMap -}}
{{- end -}}
{{- define "ghostgpu.webConfigName" -}}
{{- default (printf "%s-web-config" (include "ghostgpu.fullname" .)) .Values.webConfig.existingSecret -}}
{{- end -}}
{{- define "ghostgpu.scrapeAuthName" -}}
{{- default (printf "%s-scrape-auth" (include "ghostgpu.fullname" .)) .Values.webConfig.scrapeAuth.existingSecret -}}
{{- end -}}
{{- define "ghostgpu.replicated" -}}{{ if eq .Values.collector.store.scheme "postgresql" }}true{{ end }}{{- end -}}
{{- define "ghostgpu.isolateNode" -}}
{{- if and .Values.remediation.enabled (dig "actions" "isolate_node" false .Values.remediation.config) }}true{{ end -}}
{{- end -}}

{{/* The Secret (type kubernetes.io/tls, with ca.crt) each serving certificate is read from. */}}
{{- define "ghostgpu.collectorTLSSecret" -}}
{{- if .Values.tls.existingSecrets.collector -}}
{{- .Values.tls.existingSecrets.collector -}}
{{- else -}}
{{- include "ghostgpu.collectorName" . }}-tls
{{- end -}}
{{- end -}}
{{- define "ghostgpu.tracerMetricsTLSSecret" -}}
{{- if .Values.tls.existingSecrets.tracerMetrics -}}
{{- .Values.tls.existingSecrets.tracerMetrics -}}
{{- else -}}
{{- include "ghostgpu.tracerMetricsName" . }}-tls
{{- end -}}
{{- end -}}

{{/* The name tracers dial and TLS checks: the headless Service for the replicas, else the Service. */}}
{{- define "ghostgpu.collectorTarget" -}}
{{- $service := ternary (include "ghostgpu.collectorHeadlessName" .) (include "ghostgpu.collectorName" .) (eq (include "ghostgpu.replicated" .) "true") -}}
{{- printf "%s.%s.svc:%d" $service .Release.Namespace (int .Values.collector.ports.grpc) -}}
{{- end -}}

{{/*
The checks a JSON schema cannot make, each failing the render with one line naming the values. Called
by every template that depends on them, so that `helm template --show-only` checks them too.
*/}}
{{- define "ghostgpu.validate" -}}
{{- $tlsModes := list -}}
{{- if .Values.certManager.enabled -}}{{- $tlsModes = append $tlsModes "certManager.enabled" -}}{{- end -}}
{{- if or .Values.tls.existingSecrets.collector .Values.tls.existingSecrets.tracerMetrics -}}
{{- $tlsModes = append $tlsModes "tls.existingSecrets" -}}
{{- if not (and .Values.tls.existingSecrets.collector .Values.tls.existingSecrets.tracerMetrics) -}}
{{- fail "tls.existingSecrets: set both collector and tracerMetrics (Secrets of type kubernetes.io/tls with ca.crt)" -}}
{{- end -}}
{{- end -}}
{{- $files := .Values.tls.files -}}
{{- if or $files.caCrt $files.collectorCrt $files.collectorKey $files.tracerMetricsCrt $files.tracerMetricsKey -}}
{{- $tlsModes = append $tlsModes "tls.files" -}}
{{- if not (and $files.caCrt $files.collectorCrt $files.collectorKey $files.tracerMetricsCrt $files.tracerMetricsKey) -}}
{{- fail "tls.files: give all five of caCrt, collectorCrt, collectorKey, tracerMetricsCrt and tracerMetricsKey (helm install --set-file tls.files.caCrt=pki/ca.crt ...)" -}}
{{- end -}}
{{- end -}}
{{- if ne (len $tlsModes) 1 -}}
{{- fail (printf "TLS: set exactly one of certManager.enabled, tls.existingSecrets, tls.files (got %s)" (ternary "none" (join ", " $tlsModes) (eq (len $tlsModes) 0))) -}}
{{- end -}}
{{- if and (gt (int .Values.collector.replicas) 1) (ne .Values.collector.store.scheme "postgresql") -}}
{{- fail (printf "collector.replicas: %d replicas need collector.store.scheme postgresql (SQLite has one writer; docs/REPLICAS.md)" (int .Values.collector.replicas)) -}}
{{- end -}}
{{- if and .Values.collector.store.sqlite.existingClaim (eq .Values.collector.store.scheme "postgresql") -}}
{{- fail "collector.store.sqlite.existingClaim: only with collector.store.scheme sqlite" -}}
{{- end -}}
{{- if and .Values.policy.existingConfigMap .Values.policy.inline -}}
{{- fail "policy: set inline or existingConfigMap, not both (existingConfigMap needs inline: \"\")" -}}
{{- end -}}
{{- if and (not .Values.policy.existingConfigMap) (not .Values.policy.inline) -}}
{{- fail "policy: set inline (the authorization policy) or existingConfigMap; without one no one may connect" -}}
{{- end -}}
{{- end -}}

{{/* The tracer's nodeSelector: the one given, else GPU feature discovery's NVIDIA label. A default
written in values.yaml would be merged by helm with the user's selector, not replaced. */}}
{{- define "ghostgpu.tracerNodeSelector" -}}
{{- toYaml (default (dict "nvidia.com/gpu.present" "true") .Values.tracer.nodeSelector) -}}
{{- end -}}

{{/* The flags `kubectl ghostgpu` needs to find this release's collector Service, beyond its defaults
(cli/kubectl_plugin.py: namespace ghostgpu, Service ghostgpu-collector, port 7450). */}}
{{- define "ghostgpu.pluginFlags" -}}
{{- $flags := list -}}
{{- if ne .Release.Namespace "ghostgpu" }}{{ $flags = append $flags (printf "--ghostgpu-namespace %s" .Release.Namespace) }}{{ end -}}
{{- $service := include "ghostgpu.collectorName" . -}}
{{- if ne $service "ghostgpu-collector" }}{{ $flags = append $flags (printf "--collector-service %s" $service) }}{{ end -}}
{{- if ne (int .Values.collector.ports.grpc) 7450 }}{{ $flags = append $flags (printf "--collector-port %d" (int .Values.collector.ports.grpc)) }}{{ end -}}
{{- join " " $flags -}}
{{- end -}}
