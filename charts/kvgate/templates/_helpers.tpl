{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kvgate.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is set; the tag defaults to appVersion.
With the `registry` value set, the repository is that registry's: REGISTRY/NAME, NAME the last part
of the repository (kvgate-operator, kvgate-worker). Arguments: (list IMAGE .Chart .Values.registry). */}}
{{- define "kvgate.image" -}}
{{- $image := index . 0 -}}
{{- $chart := index . 1 -}}
{{- $registry := index . 2 -}}
{{- $repository := $image.repository -}}
{{- if $registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" $registry) (base $image.repository) -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default $chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: kvgate-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end -}}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: kvgate-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's permissions in the namespaces it watches: operator/src/rbac.rs. */}}
{{- define "kvgate.watchRules" -}}
- apiGroups: ["kvgate.dev"]
  resources: ["inferencedeployments"]
  verbs: ["list", "watch"]
- apiGroups: ["kvgate.dev"]
  resources: ["inferencedeployments/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "delete", "list", "patch", "watch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "list", "patch", "watch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create", "list", "patch", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles"]
  verbs: ["create", "list", "patch", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["create", "list", "patch", "watch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["create", "delete", "get", "list", "patch", "watch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "list", "patch", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* The Secret holding the operator's root key, in the release namespace. */}}
{{- define "kvgate.rootKeySecret" -}}
{{ include "kvgate.fullname" . }}-root-key
{{- end -}}
