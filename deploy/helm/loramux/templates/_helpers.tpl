{{/* Chart name, shortened to a DNS label. */}}
{{- define "loramux.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every object's name: <release>-loramux, or the release name alone when it
already contains the chart name. */}}
{{- define "loramux.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "loramux.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "loramux.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels of every object; call with the root context. */}}
{{- define "loramux.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/name: {{ include "loramux.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "platform"). */}}
{{- define "loramux.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loramux.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: (dict "root" $ "component" "platform"). */}}
{{- define "loramux.componentLabels" -}}
{{ include "loramux.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "loramux.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "loramux.secretName" -}}
{{- .Values.secrets.existingSecret | default (include "loramux.fullname" .) }}
{{- end }}

{{/* Pod annotations that roll the pods when the settings change. */}}
{{- define "loramux.configChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}

{{/* env entries reading Secret keys named like the variables:
(dict "root" $ "keys" (list "LORAMUX_..." ...) "optional" false). */}}
{{- define "loramux.secretEnv" -}}
{{- $secret := include "loramux.secretName" .root }}
{{- $optional := .optional }}
{{- range .keys }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
      optional: {{ $optional }}
{{- end }}
{{- end }}

{{/* The S3 credentials, optional: without them boto3 uses the pod's own identity. */}}
{{- define "loramux.storeCredentialsEnv" -}}
{{- include "loramux.secretEnv" (dict "root" . "keys" (list "LORAMUX_S3_ACCESS_KEY_ID" "LORAMUX_S3_SECRET_ACCESS_KEY") "optional" true) }}
{{- end }}

{{/* Pod-level fields shared by every workload: (dict "root" $ "values" .Values.<component>). */}}
{{- define "loramux.podSpecCommon" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The model volume, when model.volume is set: a pod volume, and its read-only mount. */}}
{{- define "loramux.modelVolume" -}}
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "loramux.modelVolumeMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* An HTTP probe on the container's `http` port. */}}
{{- define "loramux.httpGet" -}}
httpGet:
  path: {{ . }}
  port: http
{{- end }}

{{/* Settings of the Celery worker and beat: database, store and broker. */}}
{{- define "loramux.taskEnv" -}}
envFrom:
  - configMapRef:
      name: {{ include "loramux.fullname" . }}
env:
  {{- include "loramux.secretEnv" (dict "root" . "keys" (list "LORAMUX_DATABASE_URL" "LORAMUX_REDIS_URL" "LORAMUX_CELERY_BROKER_URL") "optional" false) | nindent 2 }}
  {{- include "loramux.storeCredentialsEnv" . | nindent 2 }}
{{- end }}
