{{/*
Chart name, truncated to 63 characters because Kubernetes name fields are
limited to that by the DNS naming spec.
*/}}
{{- define "fleetgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, truncated to 63 characters (DNS naming spec). If the
release name already contains the chart name it is used as is.
*/}}
{{- define "fleetgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Component names: the suffix is kept whole, the prefix is cut to fit 63. */}}
{{- define "fleetgate.operator.fullname" -}}
{{- printf "%s-operator" (include "fleetgate.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}
{{- define "fleetgate.router.fullname" -}}
{{- printf "%s-router" (include "fleetgate.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "fleetgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fleetgate.labels" -}}
helm.sh/chart: {{ include "fleetgate.chart" . }}
app.kubernetes.io/name: {{ include "fleetgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fleetgate
{{- end }}

{{- define "fleetgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fleetgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "fleetgate.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "fleetgate.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fleetgate.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "fleetgate.router.fullname" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The router's configuration file: router.config, with scheduling.router_replicas set
from router.replicas unless router.config sets it (replicas place new prefixes by
rendezvous so that they agree without sharing state).
*/}}
{{- define "fleetgate.router.config" -}}
{{- $cfg := deepCopy .Values.router.config }}
{{- $sched := (get $cfg "scheduling") | default (dict) }}
{{- if not (hasKey $sched "router_replicas") }}
{{- $_ := set $sched "router_replicas" (max 1 (int .Values.router.replicas)) }}
{{- end }}
{{- $_ := set $cfg "scheduling" $sched }}
{{- $id := .Values.router.identity }}
{{- if or $id.apiKeysSecret $id.gatewaySecret }}
{{- $ident := (get $cfg "identity") | default (dict) }}
{{- if $id.apiKeysSecret }}
{{- $keys := (get $ident "api_keys") | default (dict) }}
{{- $_ := set $keys "keys_file" (printf "/etc/fleetgate-identity/api-keys/%s" $id.apiKeysSecretKey) }}
{{- $_ := set $ident "api_keys" $keys }}
{{- end }}
{{- if $id.gatewaySecret }}
{{- $gw := (get $ident "trusted_gateway") | default (dict) }}
{{- $_ := set $gw "secret_file" (printf "/etc/fleetgate-identity/gateway/%s" $id.gatewaySecretKey) }}
{{- $_ := set $ident "trusted_gateway" $gw }}
{{- end }}
{{- $_ := set $cfg "identity" $ident }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}
