{{- define "rlhf-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "rlhf-operator.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rlhf-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlhf-operator.serviceAccountName" -}}
{{- default (include "rlhf-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The operator's permissions: exactly the calls operator/rlhf_operator/kube.py and Kopf make
(tests/integration/test_privilege.py compares them with the audit log of a full scenario). rlhfjobs/status get
is never called: RBAC lets the operator create the runtime Role only with permissions it holds itself. */}}
{{- define "rlhf-operator.rules" -}}
# The operator reconciles from watch caches (list + watch) of what it labels; it reads the apiserver directly only
# for the job before creating a child (get), a user's data ConfigMap (get) and an object it is about to update.
- apiGroups: ["rlhf.dev"]
  resources: ["rlhfjobs"]
  verbs: ["get", "list", "watch", "patch"]   # patch: Kopf removes the finalizer older operators (resync timer) put on jobs
- apiGroups: ["rlhf.dev"]
  resources: ["rlhfjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["list", "watch", "delete"]   # delete: a RayCluster its RayJob no longer uses (duplicate)
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "delete"]   # delete: the head pod of a run stuck past spec.progressDeadlineSeconds
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["list", "watch", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "update"]   # update: a Role/RoleBinding follows the rendered one
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create"]   # a job's environment server (spec.environment.http.server), owned by the job
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create"]   # the environment server's Service
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "patch"]   # spec.scheduling.queueName: why a job waits; spec.suspend -> Workload spec.active
# spec.environment.sandbox (kubernetes-sigs/agent-sandbox): a job's SandboxTemplate and SandboxWarmPool, owned by
# the job; the pool is watched (status.sandbox) and scaled to 0 while the job is suspended, queued or finished.
- apiGroups: ["extensions.agents.x-k8s.io"]
  resources: ["sandboxtemplates"]
  verbs: ["create"]
# get: a pool the watch has not shown yet (agent-sandbox's CRDs installed after the operator started)
- apiGroups: ["extensions.agents.x-k8s.io"]
  resources: ["sandboxwarmpools"]
  verbs: ["get", "list", "watch", "create", "patch"]
# create/get/list/watch/delete: what a job's runtime Role grants on claims (RBAC lets the operator grant only what
# it holds); deletecollection: the claims of a held job are released with its pool.
- apiGroups: ["extensions.agents.x-k8s.io"]
  resources: ["sandboxclaims"]
  verbs: ["create", "get", "list", "watch", "delete", "deletecollection"]
- apiGroups: ["agents.x-k8s.io"]
  resources: ["sandboxes"]
  verbs: ["get", "list"]   # get: the runtime Role's; list: why a warm pool cannot fill
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]   # the operator posts core/v1 Events (never events.k8s.io)
{{- end -}}
