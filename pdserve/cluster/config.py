"""The serving cluster's configuration file (``pdserve serve --config cluster.yaml``).

One YAML document whose sections are the components' own config dataclasses::

    engine:        EngineConfig   (every worker)
    router:        RouterConfig   (dispatch policy, admission, conditional disaggregation)
    pools:         prefill/decode replica counts
    kv_transfer:   backend and lease
    state_store:   StateStoreConfig (memory, or a shared Redis: worker registry, load, KV events)

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

from pdserve.cluster.state_store import StateStoreConfig
from pdserve.configs import ConfigError, doc, from_dict
from pdserve.engine.config import EngineConfig
from pdserve.router.app import RouterConfig


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = doc(1, "worker processes in this pool")


@dataclass(frozen=True)
class PoolsConfig:
    prefill: PoolConfig = doc(default_factory=lambda: PoolConfig(1),
                              help="prefill workers; replicas 0 serves colocated (decode workers prefill)")
    decode: PoolConfig = doc(default_factory=lambda: PoolConfig(1), help="decode workers (at least one)")


@dataclass(frozen=True)
class KVTransferConfig:
    backend: Literal["grpc", "torch"] = doc("grpc", "how prefill workers send KV to decode workers: grpc, or torch "
                                                    "(torch.distributed: gloo on CPU, nccl on GPU)")
    lease_ms: int = doc(10000, "how long a transfer may take from its first chunk before the decode worker "
                               "computes the prompt itself")
    reservation_ttl_ms: int = doc(120000, "how long a decode worker's reserved blocks wait for their transfer to "
                                          "begin (the prompt may queue on a busy prefill worker)")


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig = doc(default_factory=EngineConfig, help="the model engine of every worker")
    router: RouterConfig = doc(default_factory=RouterConfig, help="the OpenAI-compatible router")
    pools: PoolsConfig = doc(default_factory=PoolsConfig, help="worker pools and their sizes")
    kv_transfer: KVTransferConfig = doc(default_factory=KVTransferConfig, help="KV transfer between the pools")
    state_store: StateStoreConfig = doc(default_factory=StateStoreConfig,
                                        help="where workers register and routers find them (memory, or redis)")

    def __post_init__(self) -> None:
        if self.pools.decode.replicas < 1:
            raise ConfigError(f"pools.decode.replicas: at least one decode worker is needed, "
                              f"got {self.pools.decode.replicas}")
        if self.pools.prefill.replicas < 0:
            raise ConfigError(f"pools.prefill.replicas: must not be negative, got {self.pools.prefill.replicas}")
        if self.kv_transfer.lease_ms < 1:
            raise ConfigError(f"kv_transfer.lease_ms: must be positive, got {self.kv_transfer.lease_ms}")
        if self.kv_transfer.reservation_ttl_ms < self.kv_transfer.lease_ms:
            raise ConfigError(f"kv_transfer.reservation_ttl_ms ({self.kv_transfer.reservation_ttl_ms}) must be at "
                              f"least kv_transfer.lease_ms ({self.kv_transfer.lease_ms})")
        for key in ("disagg_min_prompt_tokens", "disagg_min_uncached_tokens"):
            if getattr(self.router, key) < 0:
                raise ConfigError(f"router.{key}: must not be negative, got {getattr(self.router, key)}")


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


def load_serve_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> ServeConfig:
    """Defaults, then the file at ``path``, then ``overrides`` (the command line's, same shape)."""
    return from_dict(ServeConfig, merge(read_yaml(path), overrides or {}), owner="config")


def to_yaml(config: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
