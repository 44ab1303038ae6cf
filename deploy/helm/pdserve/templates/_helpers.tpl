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

{{/*
The served models as a YAML list (use: include "pdserve.models" . | fromYamlArray): each with its name
("" for a one-model release), the suffix of its objects' names ("" or "-NAME") and its two pools, the
model's own pools laid over .Values.pools key by key.
*/}}
{{- define "pdserve.models" -}}
{{- $out := list }}
{{- range $m := .Values.models }}
{{- $pools := dict }}
{{- range $role := list "prefill" "decode" }}
{{- $own := index ($m.pools | default dict) $role | default dict }}
{{- $_ := set $pools $role (mergeOverwrite (deepCopy (index $.Values.pools $role)) (deepCopy $own)) }}
{{- end }}
{{- $out = append $out (dict "name" $m.name "suffix" (printf "-%s" $m.name) "pools" $pools) }}
{{- end }}
{{- if not .Values.models }}
{{- $out = list (dict "name" "" "suffix" "" "pools" (dict "prefill" .Values.pools.prefill "decode" .Values.pools.decode)) }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* Selector labels of one model's pool: include "pdserve.poolSelectorLabels" (list . ROLE MODEL) */}}
{{- define "pdserve.poolSelectorLabels" -}}
{{- include "pdserve.selectorLabels" (list (index . 0) (index . 1)) }}
{{- with (index . 2) }}
pdserve.io/model: {{ . }}
{{- end }}
{{- end }}

{{/* Every worker's gRPC address (StatefulSet pods have stable DNS names), one per line. */}}
{{- define "pdserve.workerAddresses" -}}
{{- $fullname := include "pdserve.fullname" . }}
{{- range $m := include "pdserve.models" . | fromYamlArray }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $m.pools $role }}
{{- $name := printf "%s-%s%s" $fullname $role $m.suffix }}
{{- range $i, $_ := until (int $pool.replicas) }}
{{ printf "%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $pool.grpcPort) }}
{{- end }}
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
{{- if .Values.models }}
{{- $models := dict }}
{{- $merged := include "pdserve.models" . | fromYamlArray }}
{{- range $i, $own := .Values.models }}
{{- $m := index $merged $i }}
{{- $_ := set $models $m.name (dict "aliases" ($own.aliases | default list) "engine" ($own.engine | default dict)
                                    "pools" (dict "prefill" (dict "replicas" (int $m.pools.prefill.replicas))
                                                  "decode" (dict "replicas" (int $m.pools.decode.replicas)))) }}
{{- end }}
{{- $_ := set $config "models" $models }}
{{- end }}
{{- with (include "pdserve.redisUrl" .) }}
{{- $_ := set $config "state_store" (merge (dict "backend" "redis" "url" .) ($config.state_store | default dict)) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
The Ray Serve config (serveConfigV2): one application whose builder (ray.importPath) gets the cluster
YAML as args.cluster and deploys Router, PrefillWorker and DecodeWorker (with models, a pair per model:
PrefillWorker-NAME, DecodeWorker-NAME). Each pool's replicas need its
custom Ray resource (prefill: 1 or decode: 1), which only that worker group's pods advertise, one each:
one pool replica per pod. The routers need a CPU, which only the head advertises.
*/}}
{{- define "pdserve.serveConfig" -}}
{{- $deployments := list (dict "name" "Router" "num_replicas" (int .Values.router.replicas)
                               "ray_actor_options" (dict "num_cpus" 1)) }}
{{- $cluster := include "pdserve.clusterConfig" . | fromYaml }}
{{- range $m := include "pdserve.models" . | fromYamlArray }}
{{- $rayPools := dict }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $m.pools $role }}
{{- $a := $pool.autoscaling }}
{{- $initial := min (max (int $pool.replicas) (int $a.min_replicas)) (int $a.max_replicas) }}
{{- $policy := dict "policy_function" $.Values.ray.policyFunction
                    "policy_kwargs" (merge (dict "role" $role) (deepCopy $a)) }}
{{- /* Serve's own delays off: pdserve's policy windows are the stabilisation (cluster/ray_app.py) */}}
{{- $autoscaling := dict "min_replicas" (int $a.min_replicas) "max_replicas" (int $a.max_replicas)
                         "initial_replicas" $initial "policy" $policy
                         "upscale_delay_s" 0 "downscale_delay_s" 0
                         "look_back_period_s" 2 "metrics_interval_s" 1 }}
{{- $deployments = append $deployments (dict "name" (printf "%sWorker%s" (title $role) $m.suffix)
                                              "autoscaling_config" $autoscaling
                                              "ray_actor_options" (dict "num_cpus" 0 "resources" (dict $role 1))) }}
{{- /* the same pools in the application's own config: its defaults, and the router's scale-from-zero */}}
{{- $_ := set $rayPools $role (dict "replicas" $initial "num_cpus" 0 "resources" (dict $role 1)
                                   "autoscaling" (deepCopy $a)) }}
{{- end }}
{{- if $m.name }}
{{- $_ := set (index $cluster.models $m.name) "pools" $rayPools }}
{{- else }}
{{- $_ := set $cluster "pools" $rayPools }}
{{- end }}
{{- end }}
{{- $app := dict "name" "pdserve" "route_prefix" "/" "import_path" .Values.ray.importPath
                 "args" (dict "cluster" $cluster)
                 "deployments" $deployments }}
{{- toYaml (dict "proxy_location" "EveryNode"
                 "http_options" (dict "host" "0.0.0.0" "port" (int .Values.router.port))
                 "applications" (list $app)) }}
{{- end }}
