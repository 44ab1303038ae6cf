"""``pdserve serve`` on Ray: start or join a Ray cluster, check the pools fit it, run the Serve app.

    started = connect(config.ray)        # a local Ray instance, or the cluster at ray.address
    check_placement(config)              # every pool's resources exist on some node, else ConfigError
    run_app(config)                      # serve.start (HTTP on the router's host:port) + serve.run
    ...
    shutdown(config, started)            # delete the app (replicas drain), stop Ray if we started it

The application itself is ``ray_app.build_app``; this module only drives Ray.
"""

from __future__ import annotations

import logging
import os

from pdserve.configs import ConfigError

log = logging.getLogger(__name__)


def _import_ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:  # pragma: no cover - ray is a dependency; a trimmed install may lack it
        raise ConfigError("launcher: ray needs Ray Serve (pip install 'ray[serve]'); or use launcher: processes "
                          "(--launcher processes)") from e
    return ray, serve


def connect(ray_config) -> bool:
    """Join ``ray_config.address``, or start Ray on this machine. Returns whether we started it."""
    ray, _ = _import_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    if ray_config.address:
        log.info("joining the Ray cluster at %s", ray_config.address)
        ray.init(address=ray_config.address, namespace=ray_config.namespace, log_to_driver=False)
        return False
    log.info("starting Ray on this machine (resources: %s)", ray_config.resources or "none declared")
    # One machine: the workers serve gRPC on loopback (Ray's processes inherit this environment;
    # Ray itself always advertises the machine's outward address).
    from pdserve.cluster.ray_app import WORKER_HOST_ENV

    os.environ.setdefault(WORKER_HOST_ENV, "127.0.0.1")
    ray.init(num_cpus=ray_config.num_cpus if ray_config.num_cpus is not None else os.cpu_count(),
             num_gpus=ray_config.num_gpus, resources=dict(ray_config.resources) or None,
             namespace=ray_config.namespace, include_dashboard=False, log_to_driver=False)
    return True


def check_placement(config, node_resources: list[dict[str, float]] | None = None) -> None:
    """Refuse a pool whose replicas no node could hold, naming the key (resources, GPUs, CPUs).

    A Ray cluster that adds nodes (KubeRay's autoscaler) may not have them yet: there, joining
    with ``ray.address``, a missing resource is only a warning.
    """
    if node_resources is None:
        import ray

        node_resources = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    strict = not config.ray.address
    for role in ("prefill", "decode"):
        pool = getattr(config.pools, role)
        if pool.replicas == 0 and pool.autoscaling is None:
            continue
        wanted = {k: v for k, v in {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}.items() if v > 0}
        if any(all(n.get(k, 0.0) >= v for k, v in wanted.items()) for n in node_resources):
            continue
        keys = {"CPU": f"pools.{role}.num_cpus", "GPU": f"pools.{role}.num_gpus"}
        hint = ""
        for name, amount in wanted.items():  # name the first resource no node has enough of
            best = max((n.get(name, 0.0) for n in node_resources), default=0.0)
            if best < amount:
                key = keys.get(name, f"pools.{role}.resources.{name}")
                message = (f"{key}: each {role} replica needs {amount:g} {name}, and no Ray node has that much "
                           f"(most on one node: {best:g})")
                hint = f"; declare it (ray.resources in the config, or `ray start --resources '{{\"{name}\": N}}'`)"
                break
        else:  # each is somewhere, but never all on one node
            message = (f"pools.{role}: each {role} replica needs {wanted}, and no Ray node has all of it "
                       f"(nodes: {[{k: n.get(k, 0.0) for k in wanted} for n in node_resources]})")
        if strict:
            raise ConfigError(message + hint)
        log.warning("%s; waiting for the cluster to add such a node", message)


def run_app(config, blocking: bool = False):
    """Deploy the application and serve HTTP on the router's host and port."""
    import dataclasses

    _, serve = _import_ray()
    from pdserve.cluster.ray_app import build_app

    serve.start(http_options={"host": config.router.host, "port": config.router.port}, logging_config={
        "enable_access_log": False})
    app = build_app({"cluster": dataclasses.asdict(config)})
    log.info("deploying the Serve application %r", config.ray.app_name)
    return serve.run(app, name=config.ray.app_name, route_prefix="/", blocking=blocking)


def shutdown(config, started: bool) -> None:
    """Delete the application (every replica drains), then stop Ray if we started it."""
    ray, serve = _import_ray()
    try:
        serve.delete(config.ray.app_name)
    except Exception:
        log.exception("deleting the Serve application failed")
    if started:
        serve.shutdown()
        ray.shutdown()
