{{/* The chart name, or its override. */}}
{{- define "cascadia.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every resource name. */}}
{{- define "cascadia.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else if contains (include "cascadia.name" .) .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "cascadia.name" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cascadia.operatorName" -}}
{{- printf "%s-operator" (include "cascadia.fullname" .) -}}
{{- end -}}

{{- define "cascadia.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cascadia.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "cascadia.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cascadia.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "cascadia.labels" -}}
{{ include "cascadia.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}
