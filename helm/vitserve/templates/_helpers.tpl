{{/*
Chart name, truncated to the 63 characters of a DNS label.
*/}}
{{- define "vitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name, with the chart name unless the release name contains it.
*/}}
{{- define "vitserve.fullname" -}}
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

{{- define "vitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vitserve.labels" -}}
helm.sh/chart: {{ include "vitserve.chart" . }}
{{ include "vitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: vision-encoder
{{- end }}

{{- define "vitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vitserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "vitserve.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The Secret holding the API key ("" when no key is configured).
*/}}
{{- define "vitserve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "vitserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Whole seconds of a number that may arrive as a float (values are JSON numbers), rounded up.
*/}}
{{- define "vitserve.ceil" -}}
{{- $v := float64 . }}
{{- $i := int64 $v }}
{{- if gt $v (float64 $i) }}{{ add1 $i }}{{ else }}{{ $i }}{{ end }}
{{- end }}

{{/*
terminationGracePeriodSeconds: covers the preStop sleep plus the drain (request timeout) plus a margin.
*/}}
{{- define "vitserve.terminationGracePeriodSeconds" -}}
{{- $needed := add (int64 .Values.drain.preStopSleepSeconds) (include "vitserve.ceil" .Values.server.requestTimeoutS | int64) }}
{{- if kindIs "invalid" .Values.drain.terminationGracePeriodSeconds }}
{{- add $needed (int64 .Values.drain.marginSeconds) }}
{{- else }}
{{- $explicit := int64 .Values.drain.terminationGracePeriodSeconds }}
{{- if lt $explicit $needed }}
{{- fail (printf "drain.terminationGracePeriodSeconds (%d) must cover drain.preStopSleepSeconds + server.requestTimeoutS (%d)" $explicit $needed) }}
{{- end }}
{{- $explicit }}
{{- end }}
{{- end }}

{{/*
The value of VITSERVE_MODEL ("" leaves it to the server's default).
*/}}
{{- define "vitserve.modelArg" -}}
{{- if .Values.server.model }}
{{- .Values.server.model }}
{{- else if ne .Values.model.source "none" }}
{{- if .Values.model.path }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/*
One server value as an env var string: whole numbers without an exponent, lists comma-joined.
*/}}
{{- define "vitserve.envValue" -}}
{{- if kindIs "slice" . }}
{{- $items := list }}
{{- range . }}
{{- $items = append $items (include "vitserve.envValue" .) }}
{{- end }}
{{- join "," $items }}
{{- else if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}
{{- int64 . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/*
The server map as VITSERVE_* env vars. Left out: null, "", empty lists, false switches (except the
switches that are on by default, which false turns off).
*/}}
{{- define "vitserve.serverEnv" -}}
{{- $server := deepCopy .Values.server }}
{{- $model := include "vitserve.modelArg" . }}
{{- $_ := set $server "model" $model }}
{{- range $key, $value := $server }}
{{- if not (or (kindIs "invalid" $value) (and (kindIs "string" $value) (eq $value "")) (and (kindIs "slice" $value) (eq (len $value) 0)) (and (kindIs "bool" $value) (not $value) (not (has $key (list "batchInvariant"))))) }}
- name: {{ printf "VITSERVE_%s" ($key | snakecase | upper) }}
  value: {{ include "vitserve.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"true" when the pods find each other through the headless Service (one encoder cache across them):
peerDiscovery.enabled, or with "auto" whenever there can be more than one pod.
*/}}
{{- define "vitserve.peerDiscovery" -}}
{{- $mode := .Values.peerDiscovery.enabled }}
{{- if kindIs "bool" $mode }}
{{- if $mode }}true{{ end }}
{{- else if or .Values.autoscaling.enabled (gt (int64 .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{- define "vitserve.peersServiceName" -}}
{{- printf "%s-peers" (include "vitserve.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/*
The ring's source, for the pods and for vLLM's connector alike: server.replicasFrom as given, else the
headless Service's fully qualified name at the container port ("" when the pods do not find each other).
*/}}
{{- define "vitserve.replicasFrom" -}}
{{- if .Values.server.replicasFrom }}
{{- .Values.server.replicasFrom }}
{{- else if include "vitserve.peerDiscovery" . }}
{{- printf "dns:%s.%s.svc.%s:%d" (include "vitserve.peersServiceName" .) .Release.Namespace (trimSuffix "." .Values.peerDiscovery.clusterDomain) (int64 .Values.server.port) }}
{{- end }}
{{- end }}
