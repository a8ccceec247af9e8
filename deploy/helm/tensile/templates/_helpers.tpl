{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "tensile.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name; components append "-<component>". */}}
{{- define "tensile.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. Call with (dict "root" $ "component" "webhook"). */}}
{{- define "tensile.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "tensile.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tensile
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels a component's Deployment selects its pods by. */}}
{{- define "tensile.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tensile.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The name of a virtual node's Deployment (and of its ServiceAccount, grants and
     PodDisruptionBudget), as the cluster controller names it: <fullname>-vn-<node name>.
     Call with (dict "root" $ "node" name). */}}
{{- define "tensile.virtualNodeName" -}}
{{- printf "%s-vn-%s" (include "tensile.fullname" .root) .node -}}
{{- end -}}

{{/* Refuses virtual nodes that would share a Node, a Lease or a Deployment (a name given
     twice), and names whose Deployment name leaves its pods no room: the cluster controller
     refuses a Deployment name over 47 characters (pod names add 17 and stop at 63). */}}
{{- define "tensile.checkVirtualNodes" -}}
{{- $byName := dict }}
{{- range $i, $node := .Values.virtualNodes.nodes }}
{{- if hasKey $byName $node.name }}
{{- fail (printf "virtualNodes.nodes[%d].name %q is also virtualNodes.nodes[%s].name: each lower cluster is one Node of its own name" $i $node.name (get $byName $node.name)) }}
{{- end }}
{{- $_ := set $byName $node.name (toString $i) }}
{{- $deployment := include "tensile.virtualNodeName" (dict "root" $ "node" $node.name) }}
{{- if gt (len $deployment) 47 }}
{{- fail (printf "virtualNodes.nodes[%d].name %q makes the Deployment %q (%s-vn-<name>) of %d characters: its pods' names would pass 63; keep it within 47 with a name of at most %d characters, or shorten the release name (or set fullnameOverride)" $i $node.name $deployment (include "tensile.fullname" $) (len $deployment) (sub 47 (len (printf "%s-vn-" (include "tensile.fullname" $))))) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A component's own pod labels (`podLabels`), to follow its selector labels; a key the
     chart selects pods by is refused. Call with (dict "c" .Values.webhook "values" "webhook"). */}}
{{- define "tensile.podLabels" -}}
{{- range $key, $_ := .c.podLabels }}
{{- if has $key (list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "tensile.io/virtual-node") }}
{{- fail (printf "%s.podLabels: %q is a label the chart selects the pods by; use another key" $.values $key) }}
{{- end }}
{{- end }}
{{- with .c.podLabels }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{/* The image, tag defaulting to the appVersion. */}}
{{- define "tensile.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The exclusions ConfigMap the descheduler writes and the webhook and multi-scheduler read. */}}
{{- define "tensile.exclusions" -}}
{{ .Release.Namespace }}/{{ include "tensile.fullname" . }}-exclusions
{{- end -}}

{{/* Flags every daemon takes the same way. */}}
{{- define "tensile.commonArgs" -}}
- --admin-addr=0.0.0.0:{{ .Values.adminPort }}
- --log-format={{ .Values.logFormat }}
- --log-level={{ .Values.logLevel }}
{{- end -}}

{{/* Leader-election flags, whatever the replica count: a rolling update of one replica runs
     two pods for a while, and a scale-up must not bring a second writer. Call with $. */}}
{{- define "tensile.leaderArgs" -}}
- --leader-elect
- --leader-elect-resource-namespace={{ .Release.Namespace }}
{{- end -}}

{{/* Probes on the admin port. */}}
{{- define "tensile.probes" -}}
livenessProbe:
  httpGet: {path: /healthz, port: admin}
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: admin}
  periodSeconds: 5
  failureThreshold: 2
{{- end -}}

{{/* Pod-level settings shared by every component. Call with (dict "root" $ "c" .Values.webhook). */}}
{{- define "tensile.podSpec" -}}
securityContext:
  runAsNonRoot: true
  seccompProfile: {type: RuntimeDefault}
{{- with .c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets: {{ toYaml . | nindent 2 }}
{{- end }}
{{- with .c.nodeSelector }}
nodeSelector: {{ toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations: {{ toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity: {{ toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget keeping one replica up, when there are several. */}}
{{- define "tensile.pdb" -}}
{{- if gt (int .replicas) 1 }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels: {{- include "tensile.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  minAvailable: 1
  selector:
    matchLabels: {{- include "tensile.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A ServiceMonitor of the admin port. */}}
{{- define "tensile.serviceMonitor" -}}
{{- if and .root.Values.serviceMonitor.enabled (.root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") }}
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tensile.labels" (dict "root" .root "component" .component) | nindent 4 }}
    {{- with .root.Values.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels: {{- include "tensile.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
  endpoints:
  - port: admin
    path: /metrics
    interval: {{ .root.Values.serviceMonitor.interval }}
{{- end }}
{{- end -}}

{{/* A Service of the admin port (metrics), and of `port` when given. */}}
{{- define "tensile.adminService" -}}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels: {{- include "tensile.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  selector: {{- include "tensile.selectorLabels" (dict "root" .root "component" .component) | nindent 4 }}
  ports:
  - {name: admin, port: {{ .root.Values.adminPort }}, targetPort: admin}
  {{- if .port }}
  - {name: https, port: 443, targetPort: https}
  {{- end }}
{{- end -}}

{{/* The stash key ids every virtual node accepts, as a JSON list: stashKeys.accept, or every
     id of stashKeys.keys. */}}
{{- define "tensile.stashAccept" -}}
{{- $sk := .Values.stashKeys -}}
{{- if $sk.accept -}}
{{ toJson $sk.accept }}
{{- else -}}
{{ keys $sk.keys | sortAlpha | toJson }}
{{- end -}}
{{- end -}}

{{/* The Secret holding the stash keys. */}}
{{- define "tensile.stashSecret" -}}
{{ .Values.stashKeys.existingSecret | default (printf "%s-stash-keys" (include "tensile.fullname" .)) }}
{{- end -}}

{{/* Where a pod finds the stash keys it mounts. */}}
{{- define "tensile.stashDir" -}}
/etc/tensile/stash-keys
{{- end -}}

{{/* Admission policy variable `mark`: the node a PersistentVolume is marked with
     (tensile.io/virtual-node; volumes.rs), as made (CREATE) or as it is (UPDATE, DELETE). */}}
{{- define "tensile.volumeMark" -}}
- name: mark
  expression: >-
    (request.operation == 'CREATE' ? object : oldObject).metadata.?labels[?'tensile.io/virtual-node'].orValue('')
{{- end -}}

{{/* Admission policy validations of PersistentVolume writes: a volume is made, changed and
     deleted as a virtual node reflects one (volumes.rs), by the node its mark names. Each
     holds unless `variables.acting`; `variables.node` is the node whose volumes the writer
     may write, `variables.who` names the writer. */}}
{{- define "tensile.volumeValidations" -}}
- expression: >-
    !variables.acting || request.operation != 'CREATE'
    || (variables.node != '' && variables.mark == variables.node
        && object.metadata.?labels[?'tensile.io/upper-cluster'].orValue('') != '')
  messageExpression: >-
    'PersistentVolume ' + request.name + ': ' + variables.who + ' may make only volumes
    marked tensile.io/virtual-node=' + (variables.node == '' ? '<its node>' : variables.node)
    + ' and tensile.io/upper-cluster'
  reason: Forbidden
- expression: >-
    !variables.acting || request.operation != 'CREATE'
    || (has(object.spec.csi) && object.spec.csi.driver == 'virtual-node.tensile.io')
  messageExpression: >-
    'PersistentVolume ' + request.name + ': a volume a virtual node reflects has one source,
    the CSI driver virtual-node.tensile.io (never hostPath, local or another driver)'
  reason: Forbidden
- expression: >-
    !variables.acting || request.operation != 'CREATE'
    || (has(object.spec.nodeAffinity) && has(object.spec.nodeAffinity.required)
        && object.spec.nodeAffinity.required.nodeSelectorTerms.size() > 0
        && object.spec.nodeAffinity.required.nodeSelectorTerms.all(t, has(t.matchExpressions)
             && t.matchExpressions.exists(e, e.key == 'kubernetes.io/hostname' && e.operator == 'In'
                  && has(e.values) && e.values == [variables.node])))
  messageExpression: >-
    'PersistentVolume ' + request.name + ': a reflected volume is pinned to its node: every
    term of its node affinity requires kubernetes.io/hostname In [' + variables.node + ']'
  reason: Forbidden
- expression: >-
    !variables.acting || request.operation != 'CREATE'
    || has(object.spec.claimRef)
  messageExpression: >-
    'PersistentVolume ' + request.name + ': a reflected volume is made pre-bound to its claim
    (spec.claimRef)'
  reason: Forbidden
- expression: >-
    !variables.acting || request.operation == 'CREATE'
    || (variables.node != '' && variables.mark == variables.node
        && has(oldObject.spec.csi) && oldObject.spec.csi.driver == 'virtual-node.tensile.io')
  messageExpression: >-
    'PersistentVolume ' + request.name + ' is not reflected by a virtual node as ' + variables.who
    + ' may change or delete: only volumes marked tensile.io/virtual-node='
    + (variables.node == '' ? '<a node>' : variables.node) + ' with the CSI driver virtual-node.tensile.io'
  reason: Forbidden
- expression: >-
    !variables.acting || request.operation != 'UPDATE'
    || (object.metadata.?labels[?'tensile.io/virtual-node'] == oldObject.metadata.?labels[?'tensile.io/virtual-node']
        && object.metadata.?labels[?'tensile.io/upper-cluster'] == oldObject.metadata.?labels[?'tensile.io/upper-cluster']
        && object.spec.?claimRef == oldObject.spec.?claimRef
        && object.spec.?persistentVolumeReclaimPolicy == oldObject.spec.?persistentVolumeReclaimPolicy)
  messageExpression: >-
    'PersistentVolume ' + request.name + ': only its capacity may change; its marks, claimRef and
    reclaim policy stay as the virtual node made them'
  reason: Forbidden
- expression: >-
    !variables.acting || request.operation != 'DELETE'
    || oldObject.spec.?persistentVolumeReclaimPolicy.orValue('Delete') != 'Retain'
  messageExpression: >-
    'PersistentVolume ' + request.name + ' is retained (persistentVolumeReclaimPolicy: Retain):
    deleting it is for an administrator'
  reason: Forbidden
{{- end -}}

{{/* The match condition of the admission policies that hold for the release's accounts
     only: every ServiceAccount of the release (the cluster controller's, each virtual
     node's, the other daemons'), and nothing else in the cluster. */}}
{{- define "tensile.accountsOnly" -}}
matchConditions:
- name: an-account-of-the-release
  expression: "request.userInfo.username.startsWith('system:serviceaccount:{{ .Release.Namespace }}:{{ include "tensile.fullname" . }}-')"
{{- end -}}
