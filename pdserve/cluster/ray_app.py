"""pdserve on Ray Serve: the router and each worker pool as deployments of one application.

    Router          the OpenAI API behind Serve's HTTP proxy; finds its workers in the state store
    PrefillWorker   a replica is one prefill worker: its engine and its gRPC server
    DecodeWorker    a replica is one decode worker
    StateStore      the in-memory state store, when ``state_store.backend`` is memory (else Redis)

Ray places the replicas (``pools.<role>``: num_cpus, num_gpus, custom resources, spread),
restarts the ones that fail and actuates autoscaling; gRPC carries the data, as between plain
processes. A replica starts a ``WorkerServer`` and registers it in the state store; the router
discovers it there (router/discovery.py) exactly as it discovers a plain ``pdserve worker
--redis``, so it cannot tell the two apart. Stopping a replica (scale-down, redeploy, shutdown)
drains it: deregistered first, in-flight requests finish within ``grace_s``.

Autoscaling: each worker deployment has Serve's ``AutoscalingPolicy`` pointing at
``PoolAutoscalingPolicy``, which turns what the replicas report from
``record_autoscaling_stats()`` into ``PoolSignals`` and asks the pure ``PoolPolicy``
(cluster/autoscale.py) for the replica count. Serve's own delays are set to zero: our policy's
windows are the stabilisation. Idle means idle: a replica counts a request it served since its
last report even if none runs at the report, and the pool's sums of Serve's averages are rounded
up, so a pool at ``min_replicas: 0`` goes to zero only after a whole window without a request.
Every decision that changes the target is logged with its inputs; desired and actual replicas
per pool are Ray metrics (``ray_pdserve_autoscaler_*``).

``build_app(args)`` is the application builder: ``pdserve serve`` calls it, and a Serve config
file names it (``import_path: pdserve.cluster.ray_app:build_app``, ``args: {cluster: {...}}``,
the cluster YAML under ``cluster``). Ray is imported here and nowhere else in pdserve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingContext

from pdserve import cluster_token
from pdserve.cluster.autoscale import AutoscalingConfig, PoolPolicy, PoolSignals
from pdserve.state.store import (
    KVEventBatch,
    KVEventRecord,
    MemoryStateStore,
    RouteBatch,
    RouteRecord,
    StateStoreConfig,
    WorkerRecord,
)

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
DEPLOYMENTS = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}
POLICY_PATH = "pdserve.cluster.ray_app:PoolAutoscalingPolicy"
HOLD_LOG_INTERVAL_S = 5.0
WORKER_HOST_ENV = "PDSERVE_WORKER_HOST"
# Ray metrics: each node's metrics agent exports them as ray_<name>{pool=...}
AUTOSCALER_GAUGES = ("pdserve_autoscaler_desired_replicas", "pdserve_autoscaler_replicas")
STATS = ("queued_prompt_tokens", "running_requests", "kv_usage", "ttft_p90_ms", "tpot_p90_ms")


def _config(cluster: dict):
    from pdserve.cluster.config import ServeConfig
    from pdserve.configs import from_dict

    return from_dict(ServeConfig, cluster, owner="config")


# ---- the autoscaling policy, in Serve's controller ------------------------------------------------


def signals_from_context(ctx: AutoscalingContext) -> PoolSignals:
    """The pool's signals from what its replicas reported (each averaged over Serve's look-back)."""
    metrics = ctx.aggregated_metrics or {}

    def total(name: str) -> float:
        return sum(metrics.get(name, {}).values())

    def worst(name: str) -> float | None:
        values = [v for v in metrics.get(name, {}).values() if v > 0]  # 0: no request in the window
        return max(values) if values else None

    def some(name: str) -> int:  # rounded up: a pool busy for part of the look-back is not idle
        return math.ceil(total(name) - 1e-9)

    reporting = max(len(metrics.get("running_requests", {})), 1)
    return PoolSignals(
        # What the policy's decisions are relative to: the replicas already asked for (some may still
        # be starting). Against the running ones, a scale-up would be undone while its replica starts.
        replicas=ctx.target_num_replicas,
        queued_prompt_tokens=some("queued_prompt_tokens"),
        running_requests=some("running_requests"),
        kv_usage=total("kv_usage") / reporting,
        ttft_p90_ms=worst("ttft_p90_ms"),
        tpot_p90_ms=worst("tpot_p90_ms"),
        waiting_for_replica=ctx.total_num_requests if ctx.current_num_replicas == 0 else 0,
    )


class PoolAutoscalingPolicy:
    """Serve's policy callable for one pool: ``PoolPolicy`` behind Serve's ``AutoscalingContext``.

    Serve makes one per deployment with the manifest's ``policy_kwargs`` (``role`` and the keys of
    ``AutoscalingConfig``) and calls it every control-loop tick.
    """

    def __init__(self, role: str, **config: Any):
        from pdserve.configs import from_dict

        if role not in ROLES:
            raise ValueError(f"policy_kwargs.role: expected prefill or decode, got {role!r}")
        self.role = role
        self.policy = PoolPolicy(role, from_dict(AutoscalingConfig, config, owner=f"pools.{role}.autoscaling"))
        self.last_reason: str | None = None
        self._last_logged = -HOLD_LOG_INTERVAL_S
        # In Serve's controller only Serve's own logger is set up: log there (the controller's log file)
        self.log = logging.getLogger("ray.serve").getChild(f"pdserve.autoscaler.{role}")
        self._gauges = None

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        signals = signals_from_context(ctx)
        now = time.monotonic()
        decision = self.policy.decide(signals, now)
        moved = decision.desired != ctx.target_num_replicas
        turned = decision.reason != self.last_reason and now - self._last_logged >= HOLD_LOG_INTERVAL_S
        if moved or turned:  # every move; a hold when its reason changes, at most every few seconds
            self._last_logged = now
            self.log.info("autoscaler %s: %d -> %d replicas (%s; raw %d; %d running) signals %s", self.role,
                          ctx.target_num_replicas, decision.desired, decision.reason, decision.raw,
                          ctx.current_num_replicas, dataclasses.asdict(signals))
        self.last_reason = decision.reason
        self._export(decision.desired, ctx.current_num_replicas)
        return decision.desired, ctx.policy_state

    def _export(self, desired: int, current: int) -> None:
        if self._gauges is None:
            self._gauges = _gauges()
        if self._gauges:
            self._gauges[0].set(desired, tags={"pool": self.role})
            self._gauges[1].set(current, tags={"pool": self.role})


def _gauges() -> tuple:
    """Ray metrics (exported with a ``ray_`` prefix by each node's metrics agent); none outside Ray."""
    import ray

    if not ray.is_initialized():
        return ()
    from ray.util.metrics import Gauge

    desired, actual = AUTOSCALER_GAUGES
    return (Gauge(desired, "replicas the pool's policy asks for", ("pool",)),
            Gauge(actual, "replicas of the pool running", ("pool",)))


# ---- the deployments' options, from the cluster YAML ----------------------------------------------


def _replica_env(interval_s: float, security: dict[str, str] | None = None) -> dict[str, str]:
    """The replicas' environment: how often they (their load) and handles (requests waiting for a
    pool at zero) report to Serve's controller (Ray's default, 10 s, would be most of a scaling
    window), and the cluster token and TLS settings their gRPC wants and sends (cluster_token.py)."""
    return {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(interval_s),
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(interval_s), **(security or {})}


def deployment_name(role: str, model: str = "") -> str:
    """A pool's Serve deployment: PrefillWorker/DecodeWorker, with the model's name when several are
    served (one deployment pair per model)."""
    return f"{DEPLOYMENTS[role]}-{model}" if model else DEPLOYMENTS[role]


def deployment_options(config, role: str, security: dict[str, str] | None = None, model: str = "") -> dict[str, Any]:
    """``Deployment.options(...)`` for a pool (of ``model``, when several are served): placement, size
    or autoscaling, drain time, the cluster token. Pure."""
    pool = getattr(config.model(model).pools, role)
    interval = config.ray.metrics_interval_s
    actor: dict[str, Any] = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                             "runtime_env": {"env_vars": _replica_env(interval, security)}}
    if pool.resources:
        actor["resources"] = dict(pool.resources)
    options: dict[str, Any] = {
        "name": deployment_name(role, model),
        "ray_actor_options": actor,
        # Serve waits for this long after calling the replica's __del__ (the drain) before killing it.
        "graceful_shutdown_timeout_s": pool.grace_s + 15.0,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        "max_ongoing_requests": 64,  # Serve-handle calls only (wake, info, stats); requests go over gRPC
    }
    if pool.placement_strategy == "spread":
        options["max_replicas_per_node"] = 1
    a = pool.autoscaling
    if a is None:
        options["num_replicas"] = pool.replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas, "initial_replicas": pool.replicas,
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,  # our windows stabilise; Serve's would add to them
            # Serve averages each replica's reports over look_back_period_s (deprecated as it is,
            # metrics_interval_s is still what Serve checks the look-back against)
            "look_back_period_s": 2 * interval, "metrics_interval_s": interval,
            "policy": {"policy_function": POLICY_PATH,
                       "policy_kwargs": {"role": role, **dataclasses.asdict(a)}},
        }
    return options


# ---- the state store, for the in-memory backend ---------------------------------------------------


@serve.deployment(name="StateStore", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000)
class StateStoreDeployment(MemoryStateStore):
    """The memory backend for every replica of the application, called through its handle (one
    replica; a restart empties it, and the workers' next heartbeats fill it again)."""

    def __init__(self, store_config: dict):
        from pdserve.configs import from_dict

        super().__init__(from_dict(StateStoreConfig, store_config))


class RayStateStore:
    """A ``StateStore`` client of the StateStore deployment. Like the Redis one, an unreachable
    store (its replica restarting) answers the last known workers and drops writes, warning once."""

    def __init__(self, handle, timeout_s: float = 5.0):
        self.handle = handle
        self.timeout_s = timeout_s  # a store replica being deleted or restarted must not hold a drain up
        self._last: list[WorkerRecord] = []
        self._down = False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def _call(self, method: str, *args, default=None):
        try:
            result = await asyncio.wait_for(_awaited(getattr(self.handle, method).remote(*args)), self.timeout_s)
        except Exception as e:
            if not self._down:
                log.warning("state store unreachable (%s: %s); using the last known state", type(e).__name__, e)
                self._down = True
            return default
        if self._down:
            log.info("state store reachable again")
            self._down = False
        return result

    async def heartbeat(self, record: WorkerRecord) -> None:
        await self._call("heartbeat", record)

    async def deregister(self, worker_id: str) -> None:
        await self._call("deregister", worker_id)

    async def workers(self) -> list[WorkerRecord]:
        result = await self._call("workers", default=None)
        if result is not None:
            self._last = result
        return self._last

    async def publish_kv_events(self, events: list[KVEventRecord]) -> None:
        if events:
            await self._call("publish_kv_events", events)

    async def read_kv_events(self, cursor: str = "", count: int = 1000) -> KVEventBatch:
        return await self._call("read_kv_events", cursor, count, default=KVEventBatch([], cursor))

    async def publish_routes(self, routes: list[RouteRecord]) -> None:
        if routes:
            await self._call("publish_routes", routes)

    async def read_routes(self, cursor: str = "", count: int = 1000) -> RouteBatch:
        return await self._call("read_routes", cursor, count, default=RouteBatch([], cursor))


def _finished_requests(metrics) -> float:
    """Requests this worker has finished (its finish-reason counter, all reasons)."""
    return sum(sample.value for family in metrics.requests.collect() for sample in family.samples
               if sample.name.endswith("_total"))


async def _awaited(response):
    return await response


def _store_client(config, store_handle):
    """The state store a replica talks to: the StateStore deployment, or Redis."""
    if store_handle is not None:
        return RayStateStore(store_handle)
    from pdserve.state.store import make_state_store

    return make_state_store(config.state_store)


# ---- the worker pools -----------------------------------------------------------------------------


class _PoolWorker:
    """A replica hosting one worker: engine, gRPC server, registration; drained when Serve stops it."""

    role = "decode"

    async def __init__(self, cluster: dict, store=None, model: str = "", step_trace: str = ""):
        import ray

        from pdserve.bench.step_trace import traced_builder
        from pdserve.engine.engine import LLMEngine
        from pdserve.worker.config import WorkerConfig
        from pdserve.worker.server import WorkerServer

        config = _config(cluster)
        served = config.model(model)  # "": the one model of a cluster without models:
        pool = getattr(served.pools, self.role)
        engine_config = served.engine
        if engine_config.num_threads is None and pool.num_cpus >= 1:  # the CPUs Ray reserved for this replica
            engine_config = dataclasses.replace(engine_config, num_threads=int(pool.num_cpus))
        # (num_cpus 0, as on KubeRay where a pod hosts one replica: torch's default, or OMP_NUM_THREADS)
        engine_config = dataclasses.replace(engine_config, load_progress=False)
        self.node_id = ray.get_runtime_context().get_node_id()
        # Where routers reach this worker: the address Ray knows the node by, or WORKER_HOST_ENV where
        # whoever started Ray set it (a Ray instance on one machine: loopback).
        host = os.environ.get(WORKER_HOST_ENV) or next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id),
            ray.util.get_node_ip_address())
        self.replica = serve.get_replica_context().replica_id.unique_id
        store_config = config.state_store
        worker = WorkerConfig(
            host=host, port=0, grace_s=pool.grace_s,
            worker_id=f"{self.role}-{self.replica}", served_model_name=model, kv_backend=config.kv_transfer.backend,
            kv_lease_ms=config.kv_transfer.lease_ms, kv_reservation_ttl_ms=config.kv_transfer.reservation_ttl_ms,
            heartbeat_s=store_config.heartbeat_s, ttl_s=store_config.ttl_s)
        # the engine loads in the thread that will step it (WorkerServer.start; see AsyncEngine); with
        # step_trace (`pdserve serve --step-trace`), its steps are written as it runs, closed in __del__
        build, self.close_trace = traced_builder(lambda: LLMEngine(engine_config), step_trace, self.role,
                                                 worker.worker_id)
        self.server = WorkerServer(build, worker, self._servicer_cls())
        await self.server.start(_store_client(config, store))
        log.info("%s replica %s on node %s: worker %s at %s", self.role, self.replica, self.node_id,
                 worker.worker_id, self.server.address)

    _finished_reported = 0.0  # requests finished as of the last autoscaling report

    def _servicer_cls(self):
        from pdserve.decode_worker.server import DecodeServicer

        return DecodeServicer

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This worker's load for the pool's policy (Serve averages it over its look-back period)."""
        servicer = self.server.servicer
        if servicer is None:  # draining: stopped
            return {name: 0.0 for name in STATS}
        s = servicer.snapshot()
        ttft = servicer.metrics.recent_ttft.quantile(0.9)
        tpot = servicer.metrics.recent_tpot.quantile(0.9)
        # A request served between two reports (a short one) still counts: the pool was not idle.
        finished = _finished_requests(servicer.metrics)
        served_since = finished > self._finished_reported
        self._finished_reported = finished
        running = s.num_running + s.num_waiting
        return {"queued_prompt_tokens": float(s.waiting_prompt_tokens),
                "running_requests": float(max(running, 1 if served_since else 0)),
                "kv_usage": float(s.kv_usage),
                "ttft_p90_ms": 1000.0 * ttft if ttft is not None else 0.0,
                "tpot_p90_ms": 1000.0 * tpot if tpot is not None else 0.0}

    async def info(self) -> dict[str, Any]:
        """Where this replica runs and serves (tests, ``pdserve`` tools)."""
        import ray

        ctx = ray.get_runtime_context()
        return {"worker_id": self.server.servicer.worker_id, "address": self.server.address,
                "node_id": self.node_id, "replica": self.replica, "pid": os.getpid(),
                "resources": dict(ctx.get_assigned_resources())}

    async def wake(self) -> bool:
        """A no-op call: the router sends one when the pool has no replica, which Serve counts as a
        waiting request and answers by starting one (scale from zero)."""
        return True

    def check_health(self) -> None:
        if self.server.servicer is None:
            raise RuntimeError(f"{self.role} worker stopped")
        if self.server.engine.error is not None:
            raise RuntimeError(f"{self.role} worker's engine loop stopped: {self.server.engine.error!r}")

    async def __del__(self):
        """Serve stops this replica (scale-down, redeploy, shutdown): drain, then stop."""
        server = getattr(self, "server", None)
        if server is not None:
            await server.stop()
        close_trace = getattr(self, "close_trace", None)
        if close_trace is not None:
            close_trace()


@serve.deployment(name="DecodeWorker")
class DecodeWorker(_PoolWorker):
    role = "decode"


@serve.deployment(name="PrefillWorker")
class PrefillWorker(_PoolWorker):
    role = "prefill"

    def _servicer_cls(self):
        from pdserve.prefill_worker.server import PrefillServicer

        return PrefillServicer


# ---- the router -----------------------------------------------------------------------------------


@serve.ingress()
class _RouterIngress:
    """The OpenAI API: pdserve's Router (its FastAPI app) with the workers the state store lists."""

    def __init__(self, cluster: dict, store=None, pools: dict | None = None):
        """``pools``: each model's pool handles, {model name: {role: handle}} (scale from zero)."""
        from pdserve.cluster.serve_cli import served_models
        from pdserve.router.app import Router
        from pdserve.router.auth import Authenticator
        from pdserve.router.discovery import StoreDiscovery
        from pdserve.router.pool import WorkerPool

        config = _config(cluster)  # keys as digests from pdserve serve; a keys_file (KubeRay) is read here
        rc = config.router
        pool = WorkerPool([], poll_interval_s=rc.poll_interval_s)
        discovery = StoreDiscovery(pool, _store_client(config, store), rc.poll_interval_s, config.state_store.ttl_s)
        models = config.served()
        wakers = {m.name: PoolWaker(m.pools, (pools or {}).get(m.name, {})) for m in models}
        self.router = Router(config.router, pool, served_models(models), discovery, wakers=wakers,
                             auth=Authenticator(config.auth.resolved()), cascades=config.cascades)

    def __serve_build_asgi_app__(self):
        return self.router.create_app()


RouterDeployment = serve.deployment(name="Router")(_RouterIngress)


class PoolWaker:
    """Scale from zero: the router calls ``wake(role)`` when a pool has no worker in rotation.

    A pool that may be at zero (``autoscaling.min_replicas: 0``) gets a ``wake`` call on its
    deployment, which Serve counts as a waiting request and answers by starting a replica; the
    dispatcher then waits for a decode worker to join, up to ``cold_start_timeout_s``, and
    prefills on the decode worker while the prefill pool starts.
    """

    def __init__(self, pools, handles: dict):
        """``pools``: the model's PoolsConfig; ``handles``: its pools' deployment handles by role."""
        self.handles = {}
        self.timeouts = {}
        for role, handle in handles.items():
            a = getattr(pools, role).autoscaling
            if handle is not None and a is not None and a.min_replicas == 0:
                self.handles[role] = handle
                self.timeouts[role] = a.cold_start_timeout_s
        self._pending: dict[str, asyncio.Task] = {}

    def can_wake(self, role: str) -> bool:
        return role in self.handles

    def wake(self, role: str) -> None:
        """Start waking the pool unless it is already being woken (returns at once)."""
        if role not in self.handles:
            return
        task = self._pending.get(role)
        if task is None or task.done():
            log.info("no %s worker in rotation: waking the pool", role)
            self._pending[role] = asyncio.create_task(self._wake(role))

    async def _wake(self, role: str) -> None:
        try:
            await asyncio.wait_for(self.handles[role].wake.remote(), self.timeouts[role])
        except Exception as e:
            log.warning("waking the %s pool failed: %s: %s", role, type(e).__name__, e)


# ---- the application ------------------------------------------------------------------------------


def build_app(args: dict):
    """The Serve application: ``args = {"cluster": <the cluster YAML as a mapping>}``, and optionally
    ``"step_trace"``: a path with ``{pid}`` where every worker replica writes its engine's steps."""
    from pdserve.configs import ConfigError

    unknown = set(args) - {"cluster", "step_trace"}
    if unknown:
        raise ConfigError(f"args: unknown key(s) {sorted(unknown)}; expected cluster (and step_trace)")
    step_trace = args.get("step_trace") or ""
    if step_trace and (not isinstance(step_trace, str) or "{pid}" not in step_trace):
        raise ConfigError(f"args: step_trace {step_trace!r}: a path with {{pid}} in it (every replica writes a file "
                          f"of its own)")
    cluster = args.get("cluster") or {}
    config = _config(cluster)  # refused here, naming the key, before anything is deployed
    cluster = dataclasses.asdict(config)
    store = None
    if config.state_store.backend == "memory":
        store = StateStoreDeployment.bind(cluster["state_store"])
    handles: dict[str, dict[str, Any]] = {}  # one deployment pair per model
    for model in config.served():
        handles[model.name] = {}
        for role, cls in (("prefill", PrefillWorker), ("decode", DecodeWorker)):
            pool = getattr(model.pools, role)
            if pool.replicas > 0 or pool.autoscaling is not None:
                options = deployment_options(config, role, cluster_token.forwarded_env(), model.name)
                handles[model.name][role] = cls.options(**options).bind(cluster, store, model.name, step_trace)
    router = RouterDeployment.options(num_replicas=config.ray.router_replicas,
                            ray_actor_options={"num_cpus": config.ray.router_num_cpus, "runtime_env": {
                                "env_vars": _replica_env(config.ray.metrics_interval_s,
                                                         cluster_token.forwarded_env())}},
                            max_ongoing_requests=config.router.max_concurrent_requests + config.router.queue_size + 64,
                            graceful_shutdown_timeout_s=30.0)
    return router.bind(cluster, store, handles)
