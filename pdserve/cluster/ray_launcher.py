"""``pdserve serve`` on Ray: start or join a Ray cluster, check the pools fit it, run the Serve app.

    head = connect(config.ray)           # a Ray head we start here (RayHead), or None: joined ray.address
    check_placement(config)              # every pool's resources exist on some node, else ConfigError
    run_app(config)                      # serve.start (HTTP on the router's host:port) + serve.run
    ...
    shutdown(config, head)               # delete the app (replicas drain), stop the head if we started it

A Ray instance on this machine is ``ray start --head --block`` in a session of its own, not
``ray.init()``'s children: those share ``pdserve serve``'s process group, so a SIGTERM or Ctrl-C
sent to the group (a shell, a process supervisor) killed the GCS and raylet under the replicas
before the drain could talk to them (a 60 s hang, exit 1). In its own session only we stop it,
after the drain; it still dies with us (PR_SET_PDEATHSIG) if we are killed outright.

The application itself is ``ray_app.build_app``; this module only drives Ray.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.configs import ConfigError

log = logging.getLogger(__name__)
HEAD_STARTED = "Ray runtime started."  # what ray start prints once its processes are up
HEAD_START_TIMEOUT_S = 180.0
DEPLOY_JOIN_TIMEOUT_S = 15.0  # serve.run polls every second; an app deleted under it ends the poll
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _import_ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:  # pragma: no cover - ray is a dependency; a trimmed install may lack it
        raise ConfigError("launcher: ray needs Ray Serve (pip install 'ray[serve]'); or use launcher: processes "
                          "(--launcher processes)") from e
    return ray, serve


@dataclass
class RayHead:
    """The Ray head this command started: ``ray start --head --block``, leader of its own session."""

    process: subprocess.Popen
    address: str  # the GCS, host:port
    started: threading.Event = field(default_factory=threading.Event)
    output: deque = field(default_factory=lambda: deque(maxlen=40))  # its last lines, for errors

    def alive(self) -> bool:
        return self.process.poll() is None


# Serve's controller kills its HTTP proxy when the proxy is not ready within 5 s (10 s for a health
# check); on a small or busy machine (two cores also loading models) its start takes longer, and a
# killed first proxy fails serve.start at once. Set for the head we start (its actors inherit it);
# values already in the environment win.
SERVE_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
# Ray lowers its worker processes to nice 15 (made for batch tasks beside its own daemons). Here those
# processes are the serving engines and the router: at nice 15 any other busy program on the machine
# outruns them about 20 to 1 (a replica measured 100-150 s to construct beside two busy loops, against
# seconds at nice 0). They keep the priority of the command that started them, as the processes
# launcher's workers do.
WORKER_PRIORITY = {"RAY_worker_niceness": "0"}
HEAD_DEFAULTS = {**SERVE_PATIENCE, **WORKER_PRIORITY}


def connect(ray_config) -> RayHead | None:
    """Join ``ray_config.address``, or start a Ray head on this machine and join it (returned)."""
    ray, _ = _import_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray_config.address:
        log.info("joining the Ray cluster at %s", ray_config.address)
        ray.init(address=ray_config.address, namespace=ray_config.namespace, log_to_driver=False)
        return None
    _local_auth()
    head = start_head(ray_config)
    try:
        with _neutral_cwd():
            ray.init(address=head.address, namespace=ray_config.namespace, log_to_driver=False)
    except BaseException:
        stop_head(head)
        raise
    return head


def _local_auth() -> None:
    """Token authentication as ``ray.init()`` sets it up for a new local cluster: on unless
    RAY_AUTH_MODE says otherwise, a token generated if there is none. Set in our environment, so the
    head we start, its processes and this driver agree (``ray start`` alone turns it on only where a
    token already exists, and a driver given an address never does: they could disagree)."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def start_head(ray_config, timeout_s: float = HEAD_START_TIMEOUT_S) -> RayHead:
    """``ray start --head --block`` in a new session; returns once Ray says it has started."""
    from pdserve.cluster.launcher import die_with_parent
    from pdserve.cluster.ray_app import WORKER_HOST_ENV

    gcs, client, dashboard = _free_ports(3)  # Ray's fixed defaults would clash with any other Ray here
    cmd = [sys.executable, "-P", "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
           "--port", str(gcs), "--ray-client-server-port", str(client), "--dashboard-port", str(dashboard),
           "--dashboard-agent-listen-port", "0", "--include-dashboard", "false",
           "--num-cpus", str(ray_config.num_cpus if ray_config.num_cpus is not None else os.cpu_count())]
    if ray_config.num_gpus is not None:
        cmd += ["--num-gpus", str(ray_config.num_gpus)]
    if ray_config.resources:
        cmd += ["--resources", json.dumps(dict(ray_config.resources))]
    # One machine: the workers serve gRPC on loopback (the replicas inherit the head's environment).
    env = {**HEAD_DEFAULTS, **os.environ, WORKER_HOST_ENV: os.environ.get(WORKER_HOST_ENV, "127.0.0.1")}
    log.info("starting Ray on this machine (resources: %s)", ray_config.resources or "none declared")
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True, preexec_fn=die_with_parent)
    head = RayHead(process, f"127.0.0.1:{gcs}")
    threading.Thread(target=_follow_head, args=(head,), name="ray-head-output", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not head.started.wait(0.2):
        if not head.alive() or time.monotonic() > deadline:
            code = head.process.returncode
            stop_head(head)
            why = f"exited with status {code}" if code is not None else f"was not up after {timeout_s:.0f} s"
            raise RuntimeError(f"Ray did not start: ray start {why}; its last output:\n" + "\n".join(head.output))
    return head


def _follow_head(head: RayHead) -> None:
    """Keep the head's output (debug log, last lines for errors) and notice when it is up."""
    for line in head.process.stdout:
        line = ANSI.sub("", line.rstrip())
        head.output.append(line)
        log.debug("ray: %s", line)
        if HEAD_STARTED in line:
            head.started.set()


def stop_head(head: RayHead, timeout_s: float = 30.0) -> int | None:
    """SIGTERM the head (it stops its own processes), SIGKILL its session's group if it lingers."""
    if head.alive():
        head.process.terminate()
    try:
        return head.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("Ray (pid %d) did not stop in %.0f s; killing its processes", head.process.pid, timeout_s)
        os.killpg(head.process.pid, signal.SIGKILL)  # its session's leader: its pid is the group's id
        return head.process.wait()


@contextlib.contextmanager
def _neutral_cwd():
    """Run ray.init from an empty directory: Ray puts the driver's working directory on every
    worker's sys.path, and a stray folder named ``pdserve`` there (a clone's parent) would shadow
    the installed package in every replica."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="pdserve-") as empty:
        os.chdir(empty)
        try:
            yield
        finally:
            os.chdir(here)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def check_placement(config, node_resources: list[dict[str, float]] | None = None) -> None:
    """Refuse a pool whose replicas no node could hold, naming the key (resources, GPUs, CPUs).

    A Ray cluster that adds nodes (KubeRay's autoscaler) may not have them yet: there, joining
    with ``ray.address``, a missing resource is only a warning.
    """
    if node_resources is None:
        import ray

        node_resources = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    strict = not config.ray.address
    for model, role in ((m, role) for m in config.served() for role in ("prefill", "decode")):
        pool = getattr(model.pools, role)
        prefix = f"models.{model.name}.pools" if model.name else "pools"
        if pool.replicas == 0 and pool.autoscaling is None:
            continue
        wanted = {k: v for k, v in {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}.items() if v > 0}
        if any(all(n.get(k, 0.0) >= v for k, v in wanted.items()) for n in node_resources):
            continue
        keys = {"CPU": f"{prefix}.{role}.num_cpus", "GPU": f"{prefix}.{role}.num_gpus"}
        hint = ""
        for name, amount in wanted.items():  # name the first resource no node has enough of
            best = max((n.get(name, 0.0) for n in node_resources), default=0.0)
            if best < amount:
                key = keys.get(name, f"{prefix}.{role}.resources.{name}")
                message = (f"{key}: each {role} replica needs {amount:g} {name}, and no Ray node has that much "
                           f"(most on one node: {best:g})")
                hint = f"; declare it (ray.resources in the config, or `ray start --resources '{{\"{name}\": N}}'`)"
                break
        else:  # each is somewhere, but never all on one node
            message = (f"{prefix}.{role}: each {role} replica needs {wanted}, and no Ray node has all of it "
                       f"(nodes: {[{k: n.get(k, 0.0) for k in wanted} for n in node_resources]})")
        if strict:
            raise ConfigError(message + hint)
        log.warning("%s; waiting for the cluster to add such a node", message)


def run_app(config, blocking: bool = False, step_trace: str = ""):
    """Deploy the application and serve HTTP on the router's host and port. ``step_trace``: a path with
    ``{pid}`` where every worker replica writes its engine's steps (``pdserve serve --step-trace``)."""
    import dataclasses

    _, serve = _import_ray()
    from pdserve.cluster.ray_app import build_app

    serve.start(http_options={"host": config.router.host, "port": config.router.port}, logging_config={
        "enable_access_log": False})
    app = build_app({"cluster": dataclasses.asdict(config), **({"step_trace": step_trace} if step_trace else {})})
    log.info("deploying the Serve application %r", config.ray.app_name)
    return serve.run(app, name=config.ray.app_name, route_prefix="/", blocking=blocking)


def disconnect() -> None:
    """Leave Ray for good: ``ray.shutdown()``, with Ray's auto-connect turned off first.

    A thread still inside ``serve.run`` (a stop before the application was RUNNING) polls the
    controller every second; after a plain ``ray.shutdown()`` its next ``ray.get`` connected this
    process to Ray again, and when we then stopped the head, that new connection's core worker found
    its raylet gone and ended the whole process with status 1. Now that call raises in its thread.
    """
    import ray
    from ray._private import auto_init_hook  # ray is pinned (pyproject): this module-level switch is read per call

    auto_init_hook.enable_auto_connect = False
    ray.shutdown()


def shutdown(config, head: RayHead | None, deploying: list[threading.Thread] = ()) -> bool:
    """Delete the application (every replica drains), then stop the head if we started it.

    ``deploying`` are threads that may still be inside ``serve.run`` (it polls the controller until
    the application and the proxies are up, which can be after the router answers /ready). They are
    joined before this process leaves Ray: one caught inside a Ray call when ``ray.shutdown()`` tore
    the core worker down ended the whole process with status 1. With the application deleted (or
    the controller gone) their next poll raises, so they end within a poll interval.

    Returns whether the drain could run: False when the Ray we started had died under us.
    """
    ray, serve = _import_ray()
    drained = head is None or head.alive()
    if drained:
        try:
            serve.delete(config.ray.app_name)
        except Exception:
            log.exception("deleting the Serve application failed")
            drained = False
        if head is not None:
            serve.shutdown()
    else:
        log.error("Ray's processes were stopped under pdserve serve (ray start exited with status %s); the "
                  "replicas could not drain", head.process.returncode)
    for thread in deploying:
        thread.join(DEPLOY_JOIN_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the deploy thread is still inside serve.run after %.0f s; leaving Ray anyway",
                        DEPLOY_JOIN_TIMEOUT_S)
    disconnect()
    if head is not None:
        stop_head(head)
    return drained
