"""``pdserve serve``, ``pdserve router`` and ``pdserve worker``: the serving processes."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import threading

from pdserve.configs import ConfigError, add_arguments, collect_arguments, from_dict, to_flags
from pdserve.engine.config import EngineConfig

log = logging.getLogger(__name__)


def _serve_config(args: argparse.Namespace, **sections: dict):
    """The effective ServeConfig: defaults, then ``--config``'s file, then the given flags (``--model``,
    repeated: the models to serve)."""
    from pdserve.cluster.config import load_serve_config

    return load_serve_config(getattr(args, "config", None), {k: v for k, v in sections.items() if v},
                             models=getattr(args, "models", None))


def _with_keys(cluster):
    """The config with every API key read from where it was named and kept only as a digest (what
    a router, a Ray replica included, is given)."""
    return dataclasses.replace(cluster, auth=cluster.auth.resolved())


def _auth_overrides(args: argparse.Namespace) -> dict:
    return {k: v for k, v in (("api_key", args.api_key), ("keys_file", args.api_keys_file)) if v}


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.cluster.launcher import die_with_launcher

    die_with_launcher()
    from pdserve.engine.engine import LLMEngine
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.server import serve

    cluster = _serve_config(args, engine=collect_arguments(args, EngineConfig))
    worker_options = {"kv_backend": cluster.kv_transfer.backend, "kv_lease_ms": cluster.kv_transfer.lease_ms,
                      "kv_reservation_ttl_ms": cluster.kv_transfer.reservation_ttl_ms,
                      **_registration_options(cluster.state_store), **collect_arguments(args, WorkerConfig)}
    worker = from_dict(WorkerConfig, worker_options)
    engine_config = worker_engine(cluster, worker)
    if args.role == "prefill":
        from pdserve.prefill_worker.server import PrefillServicer as servicer
    else:
        from pdserve.decode_worker.server import DecodeServicer as servicer
    from pdserve.bench.step_trace import traced_builder

    # called in the engine's step loop thread, where it must be loaded; --step-trace: its steps written as it runs
    build, close_trace = traced_builder(lambda: LLMEngine(engine_config), worker.step_trace, args.role,
                                        worker.worker_id)
    try:
        asyncio.run(serve(build, worker, servicer))
    finally:
        close_trace()
    return 0


def worker_engine(cluster, worker) -> EngineConfig:
    """A worker's engine: that of the config's model it serves under (--served-model-name NAME, as the
    Helm chart starts them), else the config's engine section."""
    if worker.served_model_name in cluster.models:
        return cluster.models[worker.served_model_name].engine
    return cluster.engine


def cmd_timing_worker(args: argparse.Namespace) -> int:
    from pdserve.bench.timing_worker import TimingWorkerConfig, serve

    asyncio.run(serve(from_dict(TimingWorkerConfig, collect_arguments(args, TimingWorkerConfig))))
    return 0


def _registration_options(store) -> dict:
    """A worker's WorkerConfig options for registering in the state store (none for the in-memory one)."""
    if store.backend != "redis":
        return {}
    return {"redis": store.url, "heartbeat_s": store.heartbeat_s, "ttl_s": store.ttl_s}


def served_models(models) -> list:
    """The router's ServedModel of each ModelDeployment (its tokenizer loaded)."""
    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.router.models import ServedModel

    return [ServedModel(m.engine.model, load_tokenizer(m.engine.model), m.name, tuple(m.aliases)) for m in models]


def _run_router(router_config, models: list, addresses: list[str], store=None, sock=None,
                on_signal=None, grace_s: float = 30.0, ready_timeout_s: float | None = None, auth=None,
                cascades: dict | None = None) -> bool:
    """Serve the router for ``models`` (ModelDeployments) until a signal. With ``ready_timeout_s``, a
    thread prints the ready line once /ready answers 200, or gives up after that long and stops the
    server: then returns False."""
    import uvicorn

    from pdserve.cluster.startup import RouterServer
    from pdserve.router.app import Router
    from pdserve.router.auth import AuthConfig, Authenticator, warn_if_open
    from pdserve.router.pool import WorkerPool

    authenticator = Authenticator(auth or AuthConfig())
    warn_if_open(authenticator, router_config.host)
    pool = WorkerPool(addresses, poll_interval_s=router_config.poll_interval_s)
    discovery = None
    if store is not None and store.backend != "memory":
        from pdserve.router.discovery import StoreDiscovery
        from pdserve.state.store import make_state_store

        discovery = StoreDiscovery(pool, make_state_store(store), router_config.poll_interval_s, store.ttl_s)
    router = Router(router_config, pool, served_models(models), discovery, auth=authenticator, cascades=cascades)
    server = RouterServer(uvicorn.Config(router.create_app(), host=router_config.host, port=router_config.port,
                                         log_level="warning", timeout_graceful_shutdown=grace_s), on_signal)
    log.info("router on http://%s:%d, workers: %s", router_config.host, router_config.port, ", ".join(addresses))
    gave_up = threading.Event()
    if ready_timeout_s is not None:
        names = ", ".join(m.name or m.engine.model for m in models)
        threading.Thread(target=_announce_when_ready, args=(server, names, router_config, ready_timeout_s, gave_up),
                         name="ready-line", daemon=True).start()
    server.run(sockets=[sock] if sock is not None else None)
    return not gave_up.is_set()


def _announce_when_ready(server, model: str, router_config, timeout_s: float, gave_up: threading.Event) -> None:
    from pdserve.cluster.startup import announce, local_url, wait_until_ready

    url = local_url(router_config.host, router_config.port)
    try:
        if wait_until_ready(url, timeout_s, stopped=lambda: server.should_exit):
            announce(model, url, "plain processes")
    except TimeoutError as e:
        log.error("%s; stopping", e)
        gave_up.set()
        server.should_exit = True


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.cluster.launcher import die_with_launcher
    from pdserve.router.app import RouterConfig

    die_with_launcher()  # started by a launcher (a test, a benchmark): it goes when that goes

    store = {"backend": "redis", "url": args.redis} if args.redis else {}
    cluster = _with_keys(_serve_config(args, router=collect_arguments(args, RouterConfig), state_store=store,
                                       auth=_auth_overrides(args)))
    if not args.worker and cluster.state_store.backend == "memory":
        raise ValueError("give the workers' addresses (--worker HOST:PORT) or a state store to find them in "
                         "(--redis URL, or state_store in --config)")
    from pdserve.cluster.startup import bind_port, on_stop_signals

    sock = bind_port(cluster.router.host, cluster.router.port)
    on_stop_signals(_stop_now)
    try:
        _run_router(cluster.router, cluster.served(), args.worker or [], cluster.state_store, sock=sock,
                    auth=cluster.auth, cascades=cluster.cascades)
    finally:
        sock.close()
    return 0


def _serve_overrides(args: argparse.Namespace) -> dict:
    from pdserve.router.app import RouterConfig

    pools = {role: {"replicas": n} for role, n in (("prefill", args.prefill), ("decode", args.decode))
             if n is not None}
    kv = {k: v for k, v in (("backend", args.kv_backend), ("lease_ms", args.kv_lease_ms)) if v is not None}
    store = {"backend": "redis", "url": args.redis} if args.redis else {}
    overrides = {"engine": collect_arguments(args, EngineConfig), "router": collect_arguments(args, RouterConfig),
                 "pools": pools, "kv_transfer": kv, "state_store": store, "auth": _auth_overrides(args),
                 "ray": {"address": args.ray_address} if args.ray_address else {}}
    if args.launcher:
        overrides["launcher"] = args.launcher
    if args.ready_timeout_s is not None:
        overrides["ready_timeout_s"] = args.ready_timeout_s
    return overrides


# Below this many CPUs, pdserve serve on this machine serves colocated unless told otherwise: two
# pools split two cores into one thread each, and a one-thread prefill worker roughly doubles time to
# first token (README "CPU paths": p90 TTFT 2.6-3.2 s disaggregated against 1.3-1.4 s colocated at
# 0.25-0.5 req/s of 512-token prompts on two cores).
DISAGGREGATE_FROM_CPUS = 4


def _effective_serve_config(args: argparse.Namespace):
    """The configuration pdserve serve runs: flags over the file over the defaults, with the pools'
    default for a small machine (colocated) for every model whose prefill pool neither sized; and
    why, if so."""
    from pdserve.cluster.config import read_yaml

    cluster = _with_keys(_serve_config(args, **_serve_overrides(args)))
    file = read_yaml(getattr(args, "config", None))
    sized = args.prefill is not None or "prefill" in (file.get("pools") or {})
    cpus = len(os.sched_getaffinity(0))
    if sized or cluster.ray.address or cpus >= DISAGGREGATE_FROM_CPUS:
        return cluster, None

    def colocated(pools, engine, entry: dict):
        if engine.device != "cpu" or "prefill" in ((entry or {}).get("pools") or {}):
            return pools, False
        return dataclasses.replace(pools, prefill=dataclasses.replace(pools.prefill, replicas=0)), True

    why = (f"{cpus} CPUs: serving colocated (the decode worker prefills its own prompts with every core; a prefill "
           f"worker of its own would halve that and about double time to first token); --prefill 1 disaggregates "
           f"anyway")
    if not cluster.models:
        pools, changed = colocated(cluster.pools, cluster.engine, {})
        return (dataclasses.replace(cluster, pools=pools), why) if changed else (cluster, None)
    file_models = file.get("models") if isinstance(file.get("models"), dict) else {}
    models, any_changed = {}, False
    for name, m in cluster.models.items():
        pools, changed = colocated(m.pools, m.engine, file_models.get(name))
        models[name] = dataclasses.replace(m, pools=pools)
        any_changed |= changed
    return (dataclasses.replace(cluster, models=models), why) if any_changed else (cluster, None)


def cmd_config_show(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import to_yaml

    print(to_yaml(_effective_serve_config(args)[0]), end="")
    return 0


def cmd_config_digest(args: argparse.Namespace) -> int:
    import sys

    from pdserve.router.auth import key_digest

    key = sys.stdin.readline().strip()
    if not key:
        raise ValueError("no API key on standard input")
    print(key_digest(key))
    return 0


def _stop_now() -> None:
    """A stop signal before or after the router serves: unwind to the ``finally`` that drains the
    workers. Asked-for stops exit 0 (uvicorn, which takes signals while it serves, re-raises the
    one it got once it has shut down, and it lands here)."""
    raise SystemExit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    cluster, why = _effective_serve_config(args)  # validated before anything starts
    step_trace = args.step_trace or ""
    if step_trace and "{pid}" not in step_trace:
        raise ConfigError(f"--step-trace: put {{pid}} in the path ({step_trace!r}): every worker writes a file of "
                          f"its own")
    if step_trace:
        step_trace = os.path.abspath(step_trace)  # Ray's replicas do not start in this directory
    from pdserve import cluster_token

    cluster_token.ensure_token()  # this cluster's gRPC secret: the workers and the router inherit it
    if cluster.launcher == "ray":
        return _serve_on_ray(cluster, why, step_trace)
    return _serve_processes(cluster, why, step_trace)


def _serve_on_ray(cluster, why: str | None = None, step_trace: str = "") -> int:
    """The pools as Ray Serve deployments, the router behind Serve's HTTP proxy; until SIGTERM/SIGINT."""
    from pdserve.cluster import ray_launcher
    from pdserve.cluster.startup import check_port, on_stop_signals

    check_port(cluster.router.host, cluster.router.port)  # before Ray starts: Serve's proxy binds it later
    if why:
        log.info(why)
    stop = threading.Event()
    on_stop_signals(stop.set)
    head = ray_launcher.connect(cluster.ray)
    on_stop_signals(stop.set)  # again: ray.init installs its own SIGTERM handler
    code = 0
    deploying: list[threading.Thread] = []
    try:
        ray_launcher.check_placement(cluster)
        if not stop.is_set():
            code = _deploy_and_announce(cluster, stop, deploying, step_trace)
        while code == 0 and not stop.wait(0.5):
            if head is not None and not head.alive():
                log.error("Ray (pid %d) exited with status %s under pdserve serve", head.process.pid,
                          head.process.returncode)
                code = 1
        log.info("stopping: the replicas drain (up to grace_s)")
    finally:
        drained = ray_launcher.shutdown(cluster, head, deploying)
    return code if drained else 1


def _deploy_and_announce(cluster, stop: threading.Event, deploying: list[threading.Thread],
                         step_trace: str = "") -> int:
    """Deploy the application (in a thread, added to ``deploying``: a signal must not wait for every
    replica to load), then print the ready line once the router's /ready answers 200. Non-zero if
    either fails. ``step_trace``: every worker replica's engine steps to that path (``{pid}`` in it)."""
    from pdserve.cluster import ray_launcher
    from pdserve.cluster.startup import announce, local_url, wait_until_ready

    failure: list[BaseException] = []

    def deploy():
        try:
            ray_launcher.run_app(cluster, step_trace=step_trace)
        except Exception as e:  # noqa: BLE001 - reported below, unless we were stopping anyway
            if not stop.is_set():
                failure.append(e)
                stop.set()

    deploying.append(threading.Thread(target=deploy, name="deploy", daemon=True))
    deploying[-1].start()
    url = local_url(cluster.router.host, cluster.router.port)
    try:
        if wait_until_ready(url, cluster.ready_timeout_s, stopped=stop.is_set):
            announce(", ".join(m.name or m.engine.model for m in cluster.served()), url,
                     f"Ray Serve application {cluster.ray.app_name!r}")
    except TimeoutError as e:
        log.error("%s; stopping", e)
        return 1
    if failure:
        log.error("deploying the Serve application failed: %s", failure[0])
        return 1
    return 0


def _serve_processes(cluster, why: str | None = None, step_trace: str = "") -> int:
    from pdserve.cluster.launcher import signal_workers, start_worker, stop_workers, wait_ready
    from pdserve.cluster.startup import bind_port, on_stop_signals

    sock = bind_port(cluster.router.host, cluster.router.port)  # a taken port: refused before any model loads
    if why:
        log.info(why)
    grace_s = max(pool.grace_s for m in cluster.served() for pool in (m.pools.prefill, m.pools.decode))
    on_stop_signals(_stop_now)
    workers = []
    try:
        for role, flags in _worker_commands(cluster, grace_s, step_trace):
            workers.append(start_worker(role, flags))
        for m in cluster.served():
            log.info("starting %d prefill and %d decode worker(s) with %s%s", m.pools.prefill.replicas,
                     m.pools.decode.replicas, m.engine.model, f" as {m.name!r}" if m.name else "")
        wait_ready(workers, timeout_s=cluster.ready_timeout_s)
        served = _run_router(cluster.router, cluster.served(), [w.address for w in workers], cluster.state_store,
                             sock=sock, on_signal=lambda: signal_workers(workers), grace_s=grace_s,
                             ready_timeout_s=cluster.ready_timeout_s, auth=cluster.auth, cascades=cluster.cascades)
    finally:
        sock.close()
        stop_workers(workers, grace_s=grace_s + 5.0)  # signalled with the router: draining already
    return 0 if served else 1


def _worker_commands(cluster, grace_s: float, step_trace: str = "") -> list[tuple[str, list[str]]]:
    """(role, flags) of every worker process of every model: the engine's options, the model's name
    (several models), the transfer's, registration, ``--step-trace`` when given. The machine's cores are
    split over them all."""
    models = cluster.served()
    n_workers = sum(m.pools.prefill.replicas + m.pools.decode.replicas for m in models)
    commands = []
    for m in models:
        engine_options = dataclasses.asdict(m.engine)
        if m.engine.num_threads is None:
            engine_options["num_threads"] = max(1, (os.cpu_count() or 1) // n_workers)
        flags = to_flags({**engine_options, "load_progress": False})
        worker_flags = ["--host", "127.0.0.1", "--port", "0", "--grace-s", str(grace_s), *flags,
                        *(["--served-model-name", m.name] if m.name else []),
                        "--kv-lease-ms", str(cluster.kv_transfer.lease_ms),
                        "--kv-reservation-ttl-ms", str(cluster.kv_transfer.reservation_ttl_ms),
                        *to_flags(_registration_options(cluster.state_store)),
                        *(["--step-trace", step_trace] if step_trace else [])]
        decode_flags = ["--kv-backend", cluster.kv_transfer.backend]
        commands += [("prefill", worker_flags)] * m.pools.prefill.replicas
        commands += [("decode", worker_flags + decode_flags)] * m.pools.decode.replicas
    return commands


CONFIG_HELP = "a cluster YAML file (see deploy/examples/); flags override its values"
REDIS_HELP = ("share state in the Redis at this URL (redis://host:port/db): workers register there and routers "
              "discover them (default: in memory, no Redis)")


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.cluster.config import ServeConfig
    from pdserve.configs import field_help
    from pdserve.router.app import RouterConfig

    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--decode", type=int, default=None, help="number of decode workers (default: 1)")
    parser.add_argument("--prefill", type=int, default=None,
                        help="number of prefill workers; 0 serves colocated (default: 1; 0 on a CPU machine of "
                             "fewer than 4 cores unless the config file sizes the pool)")
    parser.add_argument("--kv-backend", choices=["grpc", "torch"], default=None,
                        help="how prefill workers send KV to decode workers: grpc, or torch (torch.distributed: gloo "
                             "on CPU, nccl on GPU) (default: grpc)")
    parser.add_argument("--kv-lease-ms", type=int, default=None,
                        help="how long a KV transfer may take from its first chunk before the decode worker computes "
                             "the prompt itself (default: 10000)")
    parser.add_argument("--redis", metavar="URL", default=None, help=REDIS_HELP)
    parser.add_argument("--launcher", choices=["ray", "processes"], default=None,
                        help="how the pools run: ray (Ray Serve deployments: placement, restarts, autoscaling; "
                             "a local Ray instance unless --ray-address) or processes (one plain process per "
                             "worker, fixed counts) (default: ray)")
    parser.add_argument("--ray-address", metavar="ADDRESS", default=None,
                        help="join this Ray cluster (auto, or ray://head:10001) instead of starting Ray here")
    parser.add_argument("--ready-timeout-s", type=float, default=None, metavar="SECONDS",
                        help=f"{field_help(ServeConfig, 'ready_timeout_s')} (default: {ServeConfig.ready_timeout_s:g})")
    add_arguments(parser.add_argument_group("router"), RouterConfig)
    _add_key_arguments(parser)
    engine = parser.add_argument_group("engine (every worker)")
    _add_model_argument(engine)
    add_arguments(engine, EngineConfig, skip=("model",))


def _add_model_argument(parser) -> None:
    from pdserve.configs import field_help

    parser.add_argument("--model", dest="models", action="append", metavar="MODEL", default=None,
                        help=f"{field_help(EngineConfig, 'model')}. Repeat it to serve several models, each with its "
                             f"own pools, routed by the request's `model` (the config's models: section, if any, "
                             f"keeps its settings for these names) (default: the config's, else {EngineConfig.model})")


def _add_key_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.configs import field_help
    from pdserve.router.auth import AuthConfig

    keys = parser.add_argument_group("API keys (auth: in --config for tenants)")
    keys.add_argument("--api-key", metavar="KEY", default=None, help=field_help(AuthConfig, "api_key"))
    keys.add_argument("--api-keys-file", metavar="FILE", default=None, help=field_help(AuthConfig, "keys_file"))


def add_commands(sub) -> None:
    from pdserve.router.app import RouterConfig
    from pdserve.worker.config import WorkerConfig

    serve = sub.add_parser(
        "serve", help="serve the OpenAI API: the router and the prefill and decode pools",
        description="Start the prefill and decode pools and the router in front of them; Ctrl-C or SIGTERM "
                    "stops them all (workers drain first). By default on Ray Serve: a local Ray instance (or the "
                    "cluster at --ray-address) places each pool per its YAML (num_cpus, num_gpus, resources), "
                    "restarts failed replicas and autoscales pools that have an autoscaling section. "
                    "--launcher processes runs one plain process per worker instead. Disaggregated by default "
                    "(one prefill, one decode worker; on a CPU machine of fewer than 4 cores, colocated unless "
                    "--prefill or the config file sizes the prefill pool); --prefill 0 serves colocated (decode "
                    "workers prefill their "
                    "own prompts).")
    _add_cluster_arguments(serve)
    serve.add_argument("--step-trace", metavar="PATH", default=None,
                       help="every worker (a process, or a Ray Serve replica on its node's disk) writes its "
                            "engine's steps (what each computed, its seconds) to PATH, {pid} in it replaced by the "
                            "worker's process id (a relative PATH is taken from this directory); `pdserve profile "
                            "--from-trace` fits a latency profile to them (default: off)")
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser("config", help="inspect the configuration", description="Configuration tools.")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", help="print the effective configuration as YAML",
        description="Print the configuration `pdserve serve` would run with (the --config file and any flags "
                    "laid over the defaults), every default filled in. Exits 2 naming the key if it is invalid.")
    _add_cluster_arguments(show)
    show.set_defaults(func=cmd_config_show)
    digest = config_sub.add_parser(
        "digest", help="print the SHA-256 of an API key read from standard input",
        description="For auth.tenants.<name>.key_sha256 and keys files (TENANT sha256:HEX): reads one API key "
                    "from standard input (so it stays out of the shell's history) and prints its digest.")
    digest.set_defaults(func=cmd_config_digest)

    router = sub.add_parser("router", help="run the router alone, in front of running workers",
                            description="The OpenAI-compatible router, dispatching to the given workers and "
                                        "to those registered in the state store (--redis).")
    router.add_argument("--worker", action="append", metavar="HOST:PORT",
                        help="a worker's gRPC address (repeatable); with --redis, workers are also found there")
    router.add_argument("--redis", metavar="URL", default=None, help=REDIS_HELP)
    router.add_argument("--model", dest="models", action="append", metavar="MODEL", default=None,
                        help="the model whose tokenizer and chat template to use (default: the config's, else "
                             f"{EngineConfig.model}); repeat it for workers of several models, which then name "
                             f"their model with --served-model-name")
    router.add_argument("--config", metavar="FILE", help=CONFIG_HELP + " (reads the router, engine.model and "
                                                                      "models sections)")
    add_arguments(router, RouterConfig)
    _add_key_arguments(router)
    router.set_defaults(func=cmd_router)

    worker = sub.add_parser("worker", help="run one worker alone",
                            description="A worker process hosting the engine behind gRPC.")
    roles = worker.add_subparsers(dest="role", required=True)
    decode = roles.add_parser("decode", help="a decode worker (receives KV from prefill workers, or prefills "
                                             "its own prompts)")
    decode.add_argument("--config", metavar="FILE", help=CONFIG_HELP + " (reads the engine and kv_transfer sections)")
    add_arguments(decode.add_argument_group("worker"), WorkerConfig)
    add_arguments(decode.add_argument_group("engine"), EngineConfig)
    decode.set_defaults(func=cmd_worker)
    prefill = roles.add_parser("prefill", help="a prefill worker (computes prompts, sends their KV to decode "
                                               "workers)")
    prefill.add_argument("--config", metavar="FILE", help=CONFIG_HELP + " (reads the engine section)")
    add_arguments(prefill.add_argument_group("worker"), WorkerConfig)
    add_arguments(prefill.add_argument_group("engine"), EngineConfig)
    prefill.set_defaults(func=cmd_worker)

    from pdserve.bench.timing_worker import TimingWorkerConfig

    mock = roles.add_parser(
        "timing-only", help="NOT A MODEL: emits made-up tokens at a set rate (router and harness benchmarks)",
        description="A timing-only stand-in for a worker: it answers Generate with fake tokens at a fixed rate, "
                    "each stamped with its send time. For benchmarking the router and the load generator only.")
    add_arguments(mock, TimingWorkerConfig)
    mock.set_defaults(func=cmd_timing_worker)
