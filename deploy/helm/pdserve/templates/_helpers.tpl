{{/* Names, labels and the values shared by several templates. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's prefix for every object; 40 characters leave room for "-prefill-123" and DNS. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "pdserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include "pdserve.selectorLabels" (list . "router") */}}
{{- define "pdserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The Redis URL, or nothing when there is no Redis. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s-redis.%s.svc.%s:6379/0" (include "pdserve.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}
{{- end }}

{{/* Every worker's gRPC address (StatefulSet pods have stable DNS names), one per line. */}}
{{- define "pdserve.workerAddresses" -}}
{{- $fullname := include "pdserve.fullname" . }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values.pools $role }}
{{- range $i, $_ := until (int $pool.replicas) }}
{{ printf "%s-%s-%d.%s-%s.%s.svc.%s:%d" $fullname $role $i $fullname $role $.Release.Namespace $.Values.clusterDomain (int $pool.grpcPort) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations for a pod: include "pdserve.scrapeAnnotations" (list . PORT) */}}
{{- define "pdserve.scrapeAnnotations" -}}
{{- if (index . 0).Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* The cluster YAML (pdserve/cluster/config.py: ServeConfig) the processes read. */}}
{{/*
The Secret holding the API keys file (auth.existingSecret, or the one made from auth.apiKeys); empty: no keys.
*/}}
{{- define "pdserve.authSecret" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecret }}
{{- else if .Values.auth.apiKeys }}{{ include "pdserve.fullname" . }}-api-keys
{{- end }}
{{- end }}

{{/* The Secret holding the workers' gRPC token (clusterToken.existingSecret, or the chart's own). */}}
{{- define "pdserve.clusterTokenSecret" -}}
{{- .Values.clusterToken.existingSecret | default (printf "%s-cluster-token" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The environment variable every pdserve process reads the token from (pdserve/cluster_token.py). */}}
{{- define "pdserve.clusterTokenEnv" -}}
- name: PDSERVE_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "pdserve.clusterTokenSecret" . }}, key: token}
{{- end }}

{{/* TLS for the workers' gRPC (pdserve/cluster_token.py): every pdserve container mounts the tls.existingSecret
(tls.crt, tls.key, ca.crt) here and names the files in the environment pdserve reads. */}}
{{- define "pdserve.tlsDir" -}}/etc/pdserve-tls{{- end }}

{{- define "pdserve.tlsEnv" -}}
{{- if .Values.tls.existingSecret }}
- name: PDSERVE_TLS_CERT
  value: {{ include "pdserve.tlsDir" . }}/tls.crt
- name: PDSERVE_TLS_KEY
  value: {{ include "pdserve.tlsDir" . }}/tls.key
- name: PDSERVE_TLS_CA
  value: {{ include "pdserve.tlsDir" . }}/ca.crt
{{- with .Values.tls.serverName }}
- name: PDSERVE_TLS_SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.tlsMount" -}}
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: {{ include "pdserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.tlsVolume" -}}
{{- with .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end }}

{{/* Where the router's pod mounts that Secret. */}}
{{- define "pdserve.authDir" -}}/etc/pdserve-auth{{- end }}

{{- define "pdserve.clusterConfig" -}}
{{- $config := deepCopy .Values.config }}
{{- if (include "pdserve.authSecret" .) }}
{{- /* metrics_open: the pods' scrape annotations point Prometheus at the router's /metrics, which has no key */}}
{{- $_ := set $config "auth" (merge ($config.auth | default dict)
                                    (dict "keys_file" (printf "%s/keys" (include "pdserve.authDir" .))
                                          "metrics_open" (.Values.metrics.podAnnotations | default false))) }}
{{- end }}
{{- $_ := set $config "pools" (dict "prefill" (dict "replicas" (int .Values.pools.prefill.replicas))
                                    "decode" (dict "replicas" (int .Values.pools.decode.replicas))) }}
{{- with (include "pdserve.redisUrl" .) }}
{{- $_ := set $config "state_store" (merge (dict "backend" "redis" "url" .) ($config.state_store | default dict)) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
The Ray Serve config (serveConfigV2): one application whose builder (ray.importPath) gets the cluster
YAML as args.cluster and deploys Router, PrefillWorker and DecodeWorker. Each pool's replicas need its
custom Ray resource (prefill: 1 or decode: 1), which only that worker group's pods advertise, one each:
one pool replica per pod. The routers need a CPU, which only the head advertises.
*/}}
{{- define "pdserve.serveConfig" -}}
{{- $rayPools := dict }}
{{- $deployments := list (dict "name" "Router" "num_replicas" (int .Values.router.replicas)
                               "ray_actor_options" (dict "num_cpus" 1)) }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values.pools $role }}
{{- $a := $pool.autoscaling }}
{{- $initial := min (max (int $pool.replicas) (int $a.min_replicas)) (int $a.max_replicas) }}
{{- $policy := dict "policy_function" $.Values.ray.policyFunction
                    "policy_kwargs" (merge (dict "role" $role) (deepCopy $a)) }}
{{- /* Serve's own delays off: pdserve's policy windows are the stabilisation (cluster/ray_app.py) */}}
{{- $autoscaling := dict "min_replicas" (int $a.min_replicas) "max_replicas" (int $a.max_replicas)
                         "initial_replicas" $initial "policy" $policy
                         "upscale_delay_s" 0 "downscale_delay_s" 0
                         "look_back_period_s" 2 "metrics_interval_s" 1 }}
{{- $deployments = append $deployments (dict "name" (printf "%sWorker" (title $role))
                                              "autoscaling_config" $autoscaling
                                              "ray_actor_options" (dict "num_cpus" 0 "resources" (dict $role 1))) }}
{{- /* the same pools in the application's own config: its defaults, and the router's scale-from-zero */}}
{{- $_ := set $rayPools $role (dict "replicas" $initial "num_cpus" 0 "resources" (dict $role 1)
                                   "autoscaling" (deepCopy $a)) }}
{{- end }}
{{- $cluster := include "pdserve.clusterConfig" . | fromYaml }}
{{- $_ := set $cluster "pools" $rayPools }}
{{- $app := dict "name" "pdserve" "route_prefix" "/" "import_path" .Values.ray.importPath
                 "args" (dict "cluster" $cluster)
                 "deployments" $deployments }}
{{- toYaml (dict "proxy_location" "EveryNode"
                 "http_options" (dict "host" "0.0.0.0" "port" (int .Values.router.port))
                 "applications" (list $app)) }}
{{- end }}
