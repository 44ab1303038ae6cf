"""A worker process's own knobs, for both roles, apart from the server: the command line builds
its flags from them without importing the engine (and torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.configs import doc


@dataclass(frozen=True)
class WorkerConfig:
    """A worker process's own knobs (the engine's are EngineConfig's)."""

    host: str = doc("127.0.0.1", "address to serve gRPC on")
    port: int = doc(50051, "gRPC port (0: any free port)")
    worker_id: str = doc("", "name in load snapshots and logs (default: role-host-port)")
    served_model_name: str = doc("", "the model's name as routers know it, in Info and the state store (a "
                                     "router serving several models routes by it; default: the engine's model "
                                     "name)")
    metrics_port: int | None = doc(None, "serve Prometheus metrics over HTTP on this port; 0 takes a free port, "
                                         "printed in the ready line as metrics=PORT (default: off)")
    grace_s: float = doc(30.0, "on SIGTERM, how long in-flight requests may take to finish")
    kv_lease_ms: int = doc(10000, "decode: how long a transfer may go without a chunk (each renews the lease) "
                                  "before the prompt is computed here instead")
    kv_reservation_ttl_ms: int = doc(120000, "decode: how long reserved blocks wait for their transfer to begin "
                                             "(the prompt may queue on a busy prefill worker) before they are "
                                             "released")
    kv_backend: Literal["grpc", "torch"] = doc(
        "grpc", "decode: how prefill workers send KV here: grpc, or torch (torch.distributed point-to-point: gloo "
                "on CPU, nccl on GPU; control messages over gRPC)")
    kv_fault: str = doc("", "prefill, tests only: inject a transfer fault (drop:LAYER, corrupt:LAYER, "
                            "stall:SECONDS)")
    step_trace: str = doc("", "pdserve worker: write every engine step (what it computed, its seconds) to this "
                              "JSON-lines file ({pid} in it: this process's id); `pdserve profile --from-trace` "
                              "fits a latency profile to it (empty: off)")
    redis: str = doc("", "register this worker in the Redis at this URL (redis://host:port/db) for routers "
                         "to discover; empty: not registered")
    heartbeat_s: float = doc(1.0, "with --redis: how often the worker's record and load are refreshed")
    ttl_s: float = doc(5.0, "with --redis: routers drop the worker when its record is this old")
