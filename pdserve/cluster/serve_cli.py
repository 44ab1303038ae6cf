"""``pdserve serve``, ``pdserve router`` and ``pdserve worker``: the serving processes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from pdserve.configs import add_arguments, collect_arguments, from_dict, to_flags
from pdserve.engine.config import EngineConfig

log = logging.getLogger(__name__)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return from_dict(EngineConfig, collect_arguments(args, EngineConfig))


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.decode_worker.server import WorkerConfig, WorkerServicer, serve
    from pdserve.engine.engine import LLMEngine

    config = _engine_config(args)
    worker = from_dict(WorkerConfig, collect_arguments(args, WorkerConfig))
    engine = LLMEngine(config)
    servicer = WorkerServicer
    if args.role == "prefill":
        from pdserve.prefill_worker.server import PrefillServicer

        servicer = PrefillServicer
    asyncio.run(serve(engine, worker, servicer))
    return 0


def cmd_timing_worker(args: argparse.Namespace) -> int:
    from pdserve.bench.timing_worker import TimingWorkerConfig, serve

    asyncio.run(serve(from_dict(TimingWorkerConfig, collect_arguments(args, TimingWorkerConfig))))
    return 0


def _run_router(router_config, model: str, addresses: list[str]) -> None:
    import uvicorn

    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.router.app import Router
    from pdserve.router.pool import WorkerPool

    pool = WorkerPool(addresses, poll_interval_s=router_config.poll_interval_s)
    router = Router(router_config, pool, load_tokenizer(model), model)
    server = uvicorn.Server(uvicorn.Config(router.create_app(), host=router_config.host, port=router_config.port,
                                           log_level="warning", timeout_graceful_shutdown=30))
    log.info("router on http://%s:%d, workers: %s", router_config.host, router_config.port, ", ".join(addresses))
    server.run()


def cmd_router(args: argparse.Namespace) -> int:
    from pdserve.router.app import RouterConfig

    config = from_dict(RouterConfig, collect_arguments(args, RouterConfig))
    _run_router(config, args.model, args.worker)
    return 0


def _exit_on_sigterm() -> None:
    """SIGTERM becomes SystemExit, so ``finally`` blocks (stopping the workers) run.

    uvicorn takes SIGTERM while it serves and, once shut down, raises it again with the
    handler it found: with the default one the process would die before its cleanup.
    """

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready
    from pdserve.router.app import RouterConfig

    engine_options = collect_arguments(args, EngineConfig)
    engine = from_dict(EngineConfig, engine_options)  # validate before starting anything
    router_config = from_dict(RouterConfig, collect_arguments(args, RouterConfig))
    if args.decode < 1:
        raise ValueError(f"--decode: at least one decode worker is needed, got {args.decode}")
    if args.prefill < 0:
        raise ValueError(f"--prefill: must not be negative, got {args.prefill}")
    if engine.num_threads is None:
        engine_options["num_threads"] = max(1, (os.cpu_count() or 1) // (args.decode + args.prefill))
    flags = to_flags({**engine_options, "load_progress": False})
    worker_flags = ["--host", "127.0.0.1", "--port", "0", *flags]
    if args.kv_lease_ms is not None:
        worker_flags += ["--kv-lease-ms", str(args.kv_lease_ms)]
    _exit_on_sigterm()
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    decode_flags = ["--kv-backend", args.kv_backend]
    workers = [start_worker(role, worker_flags + (decode_flags if role == "decode" else [])) for role in roles]
    try:
        log.info("starting %d prefill and %d decode worker(s) with %s", args.prefill, args.decode, engine.model)
        wait_ready(workers)
        _run_router(router_config, engine.model, [w.address for w in workers])
    finally:
        stop_workers(workers)
    return 0


def add_commands(sub) -> None:
    from pdserve.decode_worker.server import WorkerConfig
    from pdserve.router.app import RouterConfig

    serve = sub.add_parser(
        "serve", help="serve the OpenAI API with workers on this machine",
        description="Start prefill and decode workers (one process each) and the router in front of them; "
                    "Ctrl-C or SIGTERM stops them all. Disaggregated by default (one prefill, one decode worker); "
                    "--prefill 0 serves colocated (decode workers prefill their own prompts).")
    serve.add_argument("--decode", type=int, default=1, help="number of decode workers (default: 1)")
    serve.add_argument("--prefill", type=int, default=1,
                       help="number of prefill workers; 0 serves colocated (default: 1)")
    serve.add_argument("--kv-backend", choices=["grpc", "torch"], default="grpc",
                       help="how prefill workers send KV to decode workers: grpc, or torch (torch.distributed: gloo "
                            "on CPU, nccl on GPU) (default: grpc)")
    serve.add_argument("--kv-lease-ms", type=int, default=None,
                       help="how long a decode worker's reserved blocks wait for their KV (default: the worker's)")
    add_arguments(serve.add_argument_group("router"), RouterConfig)
    add_arguments(serve.add_argument_group("engine (every worker)"), EngineConfig)
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="run the router alone, in front of running workers",
                            description="The OpenAI-compatible router, dispatching to the given workers.")
    router.add_argument("--worker", action="append", required=True, metavar="HOST:PORT",
                        help="a worker's gRPC address (repeatable)")
    router.add_argument("--model", default=EngineConfig.model,
                        help="model spec whose tokenizer and chat template to use (default: %(default)s)")
    add_arguments(router, RouterConfig)
    router.set_defaults(func=cmd_router)

    worker = sub.add_parser("worker", help="run one worker alone",
                            description="A worker process hosting the engine behind gRPC.")
    roles = worker.add_subparsers(dest="role", required=True)
    decode = roles.add_parser("decode", help="a decode worker (receives KV from prefill workers, or prefills "
                                             "its own prompts)")
    add_arguments(decode.add_argument_group("worker"), WorkerConfig)
    add_arguments(decode.add_argument_group("engine"), EngineConfig)
    decode.set_defaults(func=cmd_worker)
    prefill = roles.add_parser("prefill", help="a prefill worker (computes prompts, sends their KV to decode "
                                               "workers)")
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
