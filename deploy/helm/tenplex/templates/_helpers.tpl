{{/* Name of the chart, overridable. */}}
{{- define "tenplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects (at most 63 characters, as DNS labels require). */}}
{{- define "tenplex.fullname" -}}
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

{{- define "tenplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "tenplex.labels" -}}
helm.sh/chart: {{ include "tenplex.chart" . }}
app.kubernetes.io/name: {{ include "tenplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tenplex
{{- end }}

{{/* Selector labels of one component: pass (dict "ctx" $ "role" "scheduler|store"). */}}
{{- define "tenplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tenplex.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
tenplex.io/role: {{ .role }}
{{- end }}

{{- define "tenplex.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tenplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tenplex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tenplex.secretName" -}}
{{- default (printf "%s-auth" (include "tenplex.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "tenplex.authKeysSecretName" -}}
{{- default (printf "%s-auth-keys" (include "tenplex.fullname" .)) .Values.auth.jobCredentials.existingSecret }}
{{- end }}

{{- define "tenplex.tlsEnabled" -}}
{{- if .Values.tls.enabled }}{{ $_ := required "tls.secretName is required when tls.enabled is true (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt)" .Values.tls.secretName }}true{{ end }}
{{- end }}

{{- define "tenplex.scheme" -}}
{{- ternary "https" "http" (eq (include "tenplex.tlsEnabled" .) "true") }}
{{- end }}

{{/* The scheduler's URL through its Service, which outlives any one scheduler pod: what the workers are told,
     and where the stores relay their workers' heartbeats (one report per node). */}}
{{- define "tenplex.schedulerUrl" -}}
{{- printf "%s://%s-scheduler.%s.svc:%v" (include "tenplex.scheme" .) (include "tenplex.fullname" .) .Release.Namespace .Values.scheduler.service.port }}
{{- end }}

{{/* The key set and TLS environment of the scheduler and the stores (files from the volumes below). */}}
{{- define "tenplex.securityEnv" -}}
{{- if .Values.auth.jobCredentials.enabled }}
- name: TENPLEX_AUTH_KEYS
  value: /etc/tenplex/auth-keys/{{ .Values.auth.jobCredentials.existingSecretKey }}
{{- end }}
{{- if eq (include "tenplex.tlsEnabled" .) "true" }}
- name: TENPLEX_TLS_CERT
  value: /etc/tenplex/tls/tls.crt
- name: TENPLEX_TLS_KEY
  value: /etc/tenplex/tls/tls.key
- name: TENPLEX_TLS_CA
  value: /etc/tenplex/tls/ca.crt
{{- end }}
{{- end }}

{{- define "tenplex.securityMounts" -}}
{{- if .Values.auth.jobCredentials.enabled }}
{{- /* no subPath: the kubelet swaps the whole directory when the Secret changes, and the processes re-read it */}}
- name: auth-keys
  mountPath: /etc/tenplex/auth-keys
  readOnly: true
{{- end }}
{{- if eq (include "tenplex.tlsEnabled" .) "true" }}
- name: tls
  mountPath: /etc/tenplex/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "tenplex.securityVolumes" -}}
{{- if .Values.auth.jobCredentials.enabled }}
- name: auth-keys
  secret:
    secretName: {{ include "tenplex.authKeysSecretName" . }}
    defaultMode: 0400
{{- end }}
{{- if eq (include "tenplex.tlsEnabled" .) "true" }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0400
{{- end }}
{{- end }}

{{/* The TENPLEX_TOKEN environment entry, from the chart's Secret or an existing one. */}}
{{- define "tenplex.tokenEnv" -}}
- name: TENPLEX_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tenplex.secretName" . }}
      key: {{ .Values.auth.existingSecretKey }}
{{- end }}

{{- /* What the scheduler does to jobs and their pods; granted cluster-wide or per watched namespace. */}}
{{- define "tenplex.jobRules" }}
{{- /* Exactly what the scheduler calls (tests/k8s/test_k8s_rbac.py records it and compares): ElasticJobs are
       watched and only their status is written; worker pods are created, watched and deleted, and a standby
       pod's labels and annotations are patched when it is given a new generation's workers. */}}
- apiGroups: ["tenplex.io"]
  resources: ["elasticjobs"]
  verbs: ["list", "watch"]
- apiGroups: ["tenplex.io"]
  resources: ["elasticjobs/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "list", "watch", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- /* Job state the ElasticJob status has no room for: the internal status and the PTC of each generation. */}}
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "get", "list", "patch", "delete"]
{{- /* A budget per job, so that kubectl drain waits while the scheduler moves the workers and their state;
       owned by the ElasticJob, so the garbage collector deletes it with the job. */}}
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create"]
{{- end }}

{{- /* The namespaces whose worker pods are the release's job pods: the watched ones (and the release's), or all. */}}
{{- define "tenplex.jobNamespaceSelector" -}}
{{- if .Values.scheduler.watchNamespaces }}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: In
      values:
        {{- range (append .Values.scheduler.watchNamespaces .Release.Namespace | uniq) }}
        - {{ . | quote }}
        {{- end }}
{{- else }}
namespaceSelector: {}
{{- end }}
{{- end }}
