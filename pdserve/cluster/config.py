"""The serving cluster's configuration file (``pdserve serve --config cluster.yaml``).

One YAML document whose sections are the components' own config dataclasses::

    engine:        EngineConfig   (every worker; with models: the base every model's engine overrides)
    router:        RouterConfig   (dispatch policy, admission, conditional disaggregation)
    auth:          AuthConfig     (API keys and the tenants they belong to; prefix-cache sharing)
    pools:         prefill/decode: replicas, Ray placement (num_cpus, num_gpus, resources), autoscaling
    models:        several models, by the name clients send: each its engine and pools (over the two
                   sections above), aliases; the router routes by the request's ``model``
    cascades:      virtual models: a cheap model's answer when it is confident, else a dearer one's
    kv_transfer:   backend and lease
    state_store:   StateStoreConfig (memory, or a shared Redis: worker registry, load, KV events)
    launcher:      ray (Ray Serve deployments; the default) or processes
    ray:           RayConfig (the cluster to join or start, the Serve application)

Without ``models`` the cluster serves one model (``engine``, ``pools``). With it, each entry is laid
over those two sections (``expand_models``), so what all models share is written once::

    engine: {kv_cache_memory_gb: 2.0}
    models:
      smollm2-135m-instruct: {aliases: [smollm2]}     # engine.model defaults to the name
      gemma-3-270m: {pools: {decode: {replicas: 2}}}

Precedence: built-in defaults, then the file, then command-line flags. Unknown keys, wrong types
and impossible combinations are refused with a message naming the key
(``pdserve config show`` prints the effective configuration with every default filled in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from pdserve.cluster.autoscale import AutoscalingConfig
from pdserve.configs import ConfigError, doc, from_dict
from pdserve.engine.config import EngineConfig
from pdserve.router.app import RouterConfig
from pdserve.router.auth import AuthConfig
from pdserve.router.cascade import CascadeConfig
from pdserve.state.store import StateStoreConfig


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = doc(1, "workers in this pool (with autoscaling: how many to start with)")
    num_cpus: float = doc(1.0, "Ray: logical CPUs each replica reserves (its torch threads default to this)")
    num_gpus: float = doc(0.0, "Ray: GPUs each replica reserves")
    resources: dict[str, float] = doc(default_factory=dict,
                                      help="Ray: custom resources each replica needs, naming the node group it "
                                           "runs on (e.g. {prefill: 1}: only nodes started with that resource)")
    placement_strategy: Literal["default", "spread"] = doc(
        "default", "Ray: default (Ray packs replicas where resources are free) or spread (at most one replica "
                   "of this pool per node)")
    grace_s: float = doc(30.0, "scale-down and shutdown: how long a replica's in-flight requests may take to "
                               "finish (it is deregistered first)")
    autoscaling: AutoscalingConfig | None = doc(None, "Ray: scale this pool between min_replicas and "
                                                      "max_replicas with pdserve's policy (default: fixed size)")


@dataclass(frozen=True)
class RayConfig:
    address: str = doc("", "the Ray cluster to join (auto, or ray://host:10001); empty: start one on this "
                           "machine")
    num_cpus: int | None = doc(None, "local Ray: CPUs to declare (default: this machine's)")
    num_gpus: int | None = doc(None, "local Ray: GPUs to declare (default: those Ray detects)")
    resources: dict[str, float] = doc(default_factory=dict,
                                      help="local Ray: custom resources to declare, e.g. {prefill: 1, decode: 2}")
    namespace: str = doc("pdserve", "Ray namespace")
    app_name: str = doc("pdserve", "the Serve application's name")
    router_replicas: int = doc(1, "Router replicas (each serves the OpenAI API behind Serve's HTTP proxy)")
    router_num_cpus: float = doc(0.0, "logical CPUs each Router replica reserves")
    metrics_interval_s: float = doc(1.0, "how often each replica reports its load to Serve's autoscaler")

    def __post_init__(self) -> None:
        if self.router_replicas < 1:
            raise ConfigError(f"ray.router_replicas: must be at least 1, got {self.router_replicas}")
        if self.metrics_interval_s <= 0:
            raise ConfigError(f"ray.metrics_interval_s: must be positive, got {self.metrics_interval_s}")
        _check_resources("ray.resources", self.resources)


def _check_resources(key: str, resources: dict) -> None:
    for name, amount in resources.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or amount < 0:
            raise ConfigError(f"{key}.{name}: expected a non-negative number, got {amount!r}")


@dataclass(frozen=True)
class PoolsConfig:
    prefill: PoolConfig = doc(default_factory=lambda: PoolConfig(1),
                              help="prefill workers; replicas 0 serves colocated (decode workers prefill)")
    decode: PoolConfig = doc(default_factory=lambda: PoolConfig(1), help="decode workers (at least one)")

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            pool: PoolConfig = getattr(self, role)
            key = f"pools.{role}"
            if pool.replicas < 0:
                raise ConfigError(f"{key}.replicas: must not be negative, got {pool.replicas}")
            for name in ("num_cpus", "num_gpus", "grace_s"):
                if getattr(pool, name) < 0:
                    raise ConfigError(f"{key}.{name}: must not be negative, got {getattr(pool, name)}")
            _check_resources(f"{key}.resources", pool.resources)
            a = pool.autoscaling
            if a is not None and not a.min_replicas <= pool.replicas <= a.max_replicas:
                raise ConfigError(f"{key}.replicas ({pool.replicas}) must be within {key}.autoscaling's "
                                  f"min_replicas ({a.min_replicas}) and max_replicas ({a.max_replicas})")
        if self.decode.replicas < 1 and (self.decode.autoscaling is None or self.decode.autoscaling.min_replicas):
            raise ConfigError(f"pools.decode.replicas: at least one decode worker is needed, "
                              f"got {self.decode.replicas}")


@dataclass(frozen=True)
class ModelDeployment:
    """One served model: what clients call it, the engine its workers run, its own pools."""

    name: str = doc("", "the name clients send as `model` (from the key under models:; empty: a one-model "
                        "cluster, named as its workers report)")
    aliases: list[str] = doc(default_factory=list, help="other names clients may send for this model")
    engine: EngineConfig = doc(default_factory=EngineConfig, help="its workers' engine (over the top-level engine)")
    pools: PoolsConfig = doc(default_factory=PoolsConfig, help="its prefill and decode pools (over the top-level "
                                                               "pools)")

    def __post_init__(self) -> None:
        for alias in self.aliases:
            if not isinstance(alias, str) or not alias:
                raise ConfigError(f"aliases: expected non-empty names, got {alias!r}")


def expand_models(data: dict[str, Any], flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cluster mapping with every ``models`` entry laid over the top-level ``engine`` and
    ``pools`` (an entry's engine.model defaults to its name), and ``flags``' engine and pools (the
    command line's) over each entry. Idempotent."""
    models = data.get("models")
    if not models:
        return data
    if not isinstance(models, dict):
        raise ConfigError(f"models: expected a mapping of model names to their sections, got "
                          f"{type(models).__name__} {models!r}")
    expanded = {}
    for name, entry in models.items():
        entry = {} if entry is None else entry
        if not isinstance(name, str) or not name:
            raise ConfigError(f"models: a model's name must be a non-empty string, got {name!r}")
        if not isinstance(entry, dict):
            raise ConfigError(f"models.{name}: expected a mapping (aliases, engine, pools), got "
                              f"{type(entry).__name__} {entry!r}")
        for key in ("engine", "pools"):
            if not isinstance(entry.get(key) or {}, dict):
                raise ConfigError(f"models.{name}.{key}: expected a mapping, got {entry[key]!r}")
        engine = merge(data.get("engine") or {}, entry.get("engine") or {})
        if "model" not in (entry.get("engine") or {}):
            engine["model"] = name
        engine = merge(engine, (flags or {}).get("engine") or {})
        pools = merge(merge(data.get("pools") or {}, entry.get("pools") or {}), (flags or {}).get("pools") or {})
        expanded[name] = {**entry, "name": entry.get("name", name), "engine": engine, "pools": pools}
    return {**data, "models": expanded}


@dataclass(frozen=True)
class KVTransferConfig:
    backend: Literal["grpc", "torch"] = doc("grpc", "how prefill workers send KV to decode workers: grpc, or torch "
                                                    "(torch.distributed: gloo on CPU, nccl on GPU)")
    lease_ms: int = doc(10000, "how long a transfer may go without a chunk (each renews the lease) before the "
                               "decode worker computes the prompt itself")
    reservation_ttl_ms: int = doc(120000, "how long a decode worker's reserved blocks wait for their transfer to "
                                          "begin (the prompt may queue on a busy prefill worker)")


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig = doc(default_factory=EngineConfig, help="the model engine of every worker")
    router: RouterConfig = doc(default_factory=RouterConfig, help="the OpenAI-compatible router")
    auth: AuthConfig = doc(default_factory=AuthConfig, help="API keys and tenants (none: the API is open; the "
                                                            "router listens on 127.0.0.1 unless told otherwise)")
    pools: PoolsConfig = doc(default_factory=PoolsConfig, help="worker pools and their sizes")
    cascades: dict[str, CascadeConfig] = doc(
        default_factory=dict, help="virtual models by name: each runs a request on its stages (served models, the "
                                   "cheapest first) until one's answer clears its thresholds (router/cascade.py)")
    models: dict[str, ModelDeployment] = doc(
        default_factory=dict, help="several models by the name clients send, each with its engine and pools laid "
                                   "over the sections above (empty: one model, engine and pools)")
    kv_transfer: KVTransferConfig = doc(default_factory=KVTransferConfig, help="KV transfer between the pools")
    state_store: StateStoreConfig = doc(default_factory=StateStoreConfig,
                                        help="where workers register and routers find them (memory, or redis)")
    launcher: Literal["ray", "processes"] = doc("ray", "how pdserve serve runs the pools: ray (Ray Serve "
                                                       "deployments, autoscaled) or processes (plain processes)")
    ray: RayConfig = doc(default_factory=RayConfig, help="the Ray cluster and Serve application (launcher: ray)")
    ready_timeout_s: float = doc(600.0, "pdserve serve: how long the workers may take to start and a decode worker "
                                        "to join the router's rotation (the ready line waits for it) before serve "
                                        "gives up and stops")

    def __post_init__(self) -> None:
        if self.ready_timeout_s <= 0:
            raise ConfigError(f"ready_timeout_s: must be positive, got {self.ready_timeout_s}")
        for name, model in self.models.items():
            if model.name not in ("", name):
                raise ConfigError(f"models.{name}.name: the name is the key ({name!r}), got {model.name!r}")
        names: dict[str, str] = {}
        for m in self.served():
            for n in (m.name, *m.aliases):
                if n in names:
                    raise ConfigError(f"models.{m.name}: the name {n!r} is already taken by models.{names[n]}")
                names[n] = m.name
            if self.launcher == "processes":
                for role in ("prefill", "decode"):
                    if getattr(m.pools, role).autoscaling is not None:
                        where = f"models.{m.name}.pools" if m.name else "pools"
                        raise ConfigError(f"{where}.{role}.autoscaling: needs launcher: ray (plain processes "
                                          f"have no autoscaler)")
        self._check_cascades(names)
        if self.kv_transfer.lease_ms < 1:
            raise ConfigError(f"kv_transfer.lease_ms: must be positive, got {self.kv_transfer.lease_ms}")
        if self.kv_transfer.reservation_ttl_ms < self.kv_transfer.lease_ms:
            raise ConfigError(f"kv_transfer.reservation_ttl_ms ({self.kv_transfer.reservation_ttl_ms}) must be at "
                              f"least kv_transfer.lease_ms ({self.kv_transfer.lease_ms})")
        for key in ("disagg_min_prompt_tokens", "disagg_min_uncached_tokens", "cost_decode_step_s",
                    "cost_decode_step_s_per_seq", "cost_transfer_s_per_token", "cost_remote_overhead_s",
                    "cost_decode_horizon_tokens", "cost_interference", "policy_temperature", "recent_routes_s"):
            if getattr(self.router, key) < 0:
                raise ConfigError(f"router.{key}: must not be negative, got {getattr(self.router, key)}")
        if self.router.cost_prefill_tokens_per_s <= 0:
            raise ConfigError(f"router.cost_prefill_tokens_per_s: must be positive, got "
                              f"{self.router.cost_prefill_tokens_per_s}")


    def _check_cascades(self, names: dict[str, str]) -> None:
        for name, cascade in self.cascades.items():
            if name in names:
                raise ConfigError(f"cascades.{name}: the name is taken by a served model")
            for stage in cascade.stages:
                if stage not in names:
                    served = sorted(n or self.engine.model for n in names)
                    raise ConfigError(f"cascades.{name}.stages: {stage!r} is not a served model; served: {served} "
                                      f"(name them under models:)")

    def served(self) -> list[ModelDeployment]:
        """Every model this cluster serves (one, named as its workers report, without ``models``)."""
        if not self.models:
            return [ModelDeployment("", [], self.engine, self.pools)]
        return [dataclasses.replace(m, name=name) for name, m in self.models.items()]

    def model(self, name: str) -> ModelDeployment:
        return next(m for m in self.served() if m.name == name)


def read_yaml(path: str | Path | None) -> dict[str, Any]:
    """The mapping in a YAML file (empty without a path); parse errors name the file and line."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = yaml.safe_load(f)  # parse errors then name the file, line and column
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s keys laid over it, mappings merged key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_serve_config(path: str | Path | None, overrides: dict[str, Any] | None = None,
                      models: list[str] | None = None) -> ServeConfig:
    """Defaults, then the file at ``path``, then ``overrides`` (the command line's, same shape).
    ``models`` (``--model``, repeated): serve exactly these; one, without ``models`` in the file, is
    ``engine.model``; entries of the file's ``models`` by these names keep their settings."""
    data = merge(read_yaml(path), overrides or {})
    if models and (len(models) > 1 or data.get("models")):
        if len(set(models)) < len(models):
            raise ConfigError(f"--model: a model is named twice: {models}")
        file_models = data.get("models") if isinstance(data.get("models"), dict) else {}
        data["models"] = {name: file_models.get(name) or {} for name in models}
    elif models:
        data["engine"] = {**(data.get("engine") or {}), "model": models[0]}
    return from_dict(ServeConfig, expand_models(data, overrides), owner="config")  # flags win over entries too


def to_yaml(config: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
