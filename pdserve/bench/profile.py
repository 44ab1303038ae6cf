"""`pdserve profile`: the real engine's step times and KV transfer times on this machine, fitted
into the latency model of ``latency_model.py`` and written as a versioned JSON profile.

A run, in order::

    load the model, build an LLMEngine (prefix caching off: every prompt token is computed)
    warm up (a few steps, discarded)
    waves of requests (random token ids, greedy, ignore_eos, fixed max_tokens), each run to
      completion, every step timed through ``LLMEngine.step_observer`` with its features:
        prefill   one prompt per wave, chunks of 16 tokens .. the step budget, at context 0
        context   prompts longer than the budget: chunked, the last chunk after 1-2 full budgets
        decode    B prompts of C tokens then max_tokens decode steps: batch 1..64, context 32..2048
        mixed     a decoding batch, then a prompt joins it (decodes and a prefill chunk in one step)
      until the waves are done or ``max_seconds`` pass (the waves are interleaved by kind, so a
      run cut short still covers each kind)
    fit the step model (least squares, non-negative) on all steps; the same fit on 80% of them
      predicts the other 20%: that error is the ``holdout_*`` figures of the profile's ``fit``
    KV transfers: the engine's own KV cache shipped by each backend (grpc: to a real decode worker
      server in this process over 127.0.0.1; local: in-process copies) for a few sizes; a fixed cost
      plus a cost per byte fitted per backend; on a CPU engine, for grpc, also how much longer a
      prompt's step takes while it ships its KV as a prefill worker does (to a KV sink in another
      process, ``kv_sink``), a fixed cost plus a cost per byte: a prefill worker's steps pay it

The roofline (``roofline_profile``) needs no engine: a hardware description and a model shape.
The engine is driven through its public API only (add_request, step, step_observer).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pdserve.bench.latency_model import (
    HARDWARE,
    Profile,
    StepFeatures,
    StepModel,
    TransferModel,
    chunk_pairs,
    features_of,
    fit_step_model,
    roofline,
)
from pdserve.configs import ConfigError, doc
from pdserve.engine.config import DEFAULT_MODEL, PRESETS

QUICK_MODEL = "random:tiny"
BLOCK_SIZE = 16  # the engine's default
MEASURED_BACKENDS = ("grpc", "local")
# Backends that exist and that this command cannot measure, with why.
UNMEASURED_BACKENDS = {"torch": "needs two processes (a gloo/NCCL process group); see benchmarks/kv_transfer.py"}
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim")


@dataclass(frozen=True)
class ProfileConfig:
    """What `pdserve profile` measures, and where it writes."""

    model: str = doc("", f"model to measure, any spec the engine loads (default: {DEFAULT_MODEL}; "
                         f"{QUICK_MODEL} with --quick)")
    dtype: Literal["float32", "bfloat16", "float16"] = doc("float32", "weights, activations and KV-cache dtype")
    threads: int | None = doc(None, "torch intra-op threads (default: torch's choice, one per core; 1 with "
                                    "--quick, which then shrugs off a busy machine)")
    output: str = doc("profile.json", "where to write the profile (JSON)")
    quick: bool = doc(False, f"a small plan on {QUICK_MODEL} with a 256-token step budget (seconds; for tests)")
    max_seconds: float = doc(180.0, "stop starting new waves of requests after this many seconds of measuring "
                                    "steps (the plan is interleaved by kind, so a shorter run still covers each)")
    max_num_batched_tokens: int | None = doc(None, "the engine's step budget (default: 2048; 256 with --quick)")
    transfer_backends: str = doc(",".join(MEASURED_BACKENDS), "KV transfer backends to measure, comma-separated "
                                 f"({', '.join(MEASURED_BACKENDS)}; empty: none)")
    roofline: str = doc("", "write a modelled (roofline) profile for this hardware instead of measuring: "
                            + ", ".join(HARDWARE) + " (with --shape)")
    shape: str = doc("", "--roofline: the model shape, a preset: " + ", ".join(PRESETS))
    from_trace: str = doc("", "fit the profile to the steps of serving workers instead of measuring: their "
                              "--step-trace files, comma-separated (no engine run here)")
    transfer_from: str = doc("", "--from-trace: take the KV transfer models (and request overhead) from this "
                                 "profile (a trace holds neither; empty: none), without what shipping adds to a "
                                 "prefill worker's steps (its traced steps hold that)")
    trace_skip_s: float = doc(5.0, "--from-trace: leave out each trace's steps in its first seconds (a worker's "
                                   "first steps build oneDNN's kernels)")
    serving_url: str = doc("", "also measure a request's time outside engine steps through the OpenAI server (a "
                               "router) at this URL serving the profile's model: the median TTFT of short prompts "
                               "sent one at a time, less the profile's step for them (the simulator adds it to "
                               "every request; empty: not measured)")
    serving_samples: int = doc(8, "--serving-url: how many short prompts (after one warm-up)")
    plot: str = doc("", "also write a PNG of predicted against measured step times here")
    seed: int = doc(0, "seed of the random prompts and of the hold-out split")

    def __post_init__(self) -> None:
        if self.roofline and self.roofline not in HARDWARE:
            raise ConfigError(f"--roofline: unknown hardware {self.roofline!r}; one of {list(HARDWARE)}")
        if self.roofline and self.shape not in PRESETS:
            what = f"--shape: unknown preset {self.shape!r}" if self.shape else "--roofline needs --shape PRESET"
            raise ConfigError(f"{what}; one of {list(PRESETS)}")
        if self.shape and not self.roofline:
            raise ConfigError("--shape is for a modelled profile: give --roofline HW too")
        unknown = [b for b in self.backends if b not in MEASURED_BACKENDS and b not in UNMEASURED_BACKENDS]
        if unknown:
            raise ConfigError(f"--transfer-backends: unknown {unknown}; known: "
                              f"{sorted([*MEASURED_BACKENDS, *UNMEASURED_BACKENDS])}")
        if self.from_trace and self.roofline:
            raise ConfigError("--from-trace and --roofline: one source of a profile at a time")
        if self.transfer_from and not self.from_trace:
            raise ConfigError("--transfer-from goes with --from-trace (a measured profile measures its own)")
        if self.serving_url and self.roofline:
            raise ConfigError("--serving-url measures a server here; a modelled (--roofline) profile has none")
        if self.serving_samples < 1:
            raise ConfigError(f"--serving-samples must be at least 1, got {self.serving_samples}")
        if self.trace_skip_s < 0:
            raise ConfigError(f"--trace-skip-s must not be negative, got {self.trace_skip_s}")
        if self.max_seconds <= 0:
            raise ConfigError(f"--max-seconds must be positive, got {self.max_seconds}")

    @property
    def backends(self) -> list[str]:
        return [b.strip() for b in self.transfer_backends.split(",") if b.strip()]

    @property
    def traces(self) -> list[str]:
        return [t.strip() for t in self.from_trace.split(",") if t.strip()]

    @property
    def model_spec(self) -> str:
        return self.model or (QUICK_MODEL if self.quick else DEFAULT_MODEL)

    @property
    def num_threads(self) -> int | None:
        return self.threads or (1 if self.quick else None)

    @property
    def budget(self) -> int:
        return self.max_num_batched_tokens or (256 if self.quick else 2048)


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wave:
    """Requests added together and run to completion; ``late`` ones join once the first are all
    decoding (each step then holds their decodes and a chunk of a late prompt)."""

    kind: str  # prefill | context | decode | mixed | warmup
    prompts: tuple[int, ...]  # prompt lengths
    max_tokens: int
    late: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(self.prompts) + sum(self.late) + self.max_tokens * (len(self.prompts) + len(self.late))


def step_plan(budget: int, max_len: int, quick: bool = False) -> list[Wave]:
    """The waves of a run (warm-up first), interleaved by kind; none longer than ``max_len``."""
    sizes = sorted({*(16 << i for i in range(12) if 16 << i < budget), budget * 3 // 4, budget})
    prefill = [Wave("prefill", (n,), 1) for n in sizes]
    tails = (16, 128) if quick else (16, 256, budget // 2)
    context = [Wave("context", (budget + c,), 1) for c in tails]
    context += [Wave("context", (2 * budget + c,), 1) for c in ((16,) if quick else (16, budget // 2))]
    contexts = (32, 128) if quick else (32, 256, 1024, 2048)
    decode = [Wave("decode", (c,) * b, 16) for c in contexts for b in (1, 4, 16, 64) if b * c <= 8192]
    mixed = [Wave("mixed", (256,) * 8, 8, (budget // 4,)), Wave("mixed", (32,) * 32, 8, (budget // 2,))]
    if not quick:
        mixed.append(Wave("mixed", (1024,) * 4, 8, (budget + 256,)))
    kinds = [prefill, decode, context, mixed]
    waves = [Wave("warmup", (64, 64), 4), Wave("warmup", (budget,), 2)]
    for i in range(max(map(len, kinds))):
        waves += [k[i] for k in kinds if i < len(k)]
    return [w for w in waves if max(w.prompts + w.late) + w.max_tokens < max_len]


# ---- measuring steps ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSample:
    features: StepFeatures
    seconds: float
    kind: str  # the wave's

    @property
    def shape(self) -> str:
        """prefill, decode or mixed: what the step computed, whatever the wave meant it to."""
        f = self.features
        return "mixed" if f.prefill_tokens and f.decode_seqs else "prefill" if f.prefill_tokens else "decode"


class StepDriver:
    """Runs waves of requests through an engine, recording each step's features and time."""

    def __init__(self, engine, seed: int = 0):
        self.engine = engine
        self.rng = random.Random(seed)
        self.samples: list[StepSample] = []
        self._kind = ""
        self._next_id = 0

    def _observe(self, sched, seconds: float) -> None:
        self.samples.append(StepSample(features_of(sched.scheduled), seconds, self._kind))

    def _add(self, prompt_len: int, max_tokens: int) -> None:
        from pdserve.engine.sampling_params import SamplingParams

        vocab = self.engine.model_config.vocab_size
        prompt = [self.rng.randrange(100, vocab - 1) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(f"profile-{self._next_id}", prompt, params)
        self._next_id += 1

    def _step_until_all_decode(self) -> None:
        """Step until a step computes no prompt token: every request of the wave is decoding."""
        first = len(self.samples)
        while self.engine.has_unfinished():
            self.engine.step()
            if len(self.samples) > first and not self.samples[-1].features.prefill_tokens:
                return

    def run(self, wave: Wave) -> None:
        engine = self.engine
        self._kind = wave.kind
        engine.step_observer = self._observe
        try:
            for n in wave.prompts:
                self._add(n, wave.max_tokens)
            if wave.late:
                self._step_until_all_decode()
                for n in wave.late:
                    self._add(n, wave.max_tokens)
            while engine.has_unfinished():
                engine.step()
        finally:
            engine.step_observer = None


def measure_steps(engine, waves: list[Wave], max_seconds: float, seed: int = 0,
                  progress: bool = True) -> list[StepSample]:
    """Every step of ``waves`` but the warm-up's, starting no wave after ``max_seconds``."""
    from tqdm import tqdm

    driver = StepDriver(engine, seed)
    start = time.perf_counter()
    with tqdm(total=len(waves), desc="profiling engine steps", unit="wave", disable=not progress) as bar:
        for wave in waves:
            if wave.kind != "warmup" and time.perf_counter() - start > max_seconds:
                break
            driver.run(wave)
            bar.set_postfix(steps=len(driver.samples), kind=wave.kind)
            bar.update()
    return [s for s in driver.samples if s.kind != "warmup"]


def fit_with_holdout(samples: list[StepSample], seed: int = 0) -> tuple[StepModel, dict]:
    """The model fitted on every sample, with its statistics, and those of the same fit on 80% of
    the samples predicting the other 20% (``holdout_*``)."""
    import numpy as np

    pairs = [(s.features, s.seconds) for s in samples]
    model, stats = fit_step_model(pairs)
    shuffled = random.Random(seed).sample(pairs, len(pairs))
    held, train = shuffled[::5], [p for i, p in enumerate(shuffled) if i % 5]
    if len(held) >= 2 and len(train) >= 5:
        partial, _ = fit_step_model(train)
        pct = np.array([abs(partial.step_s(f) - t) / max(t, 1e-9) * 100 for f, t in held])
        stats.update(holdout_samples=len(held), holdout_mean_abs_pct_error=float(pct.mean()),
                     holdout_max_abs_pct_error=float(pct.max()))
    stats["by_shape"] = {k: sum(s.shape == k for s in samples) for k in ("prefill", "decode", "mixed")}
    return model, stats


# ---- measuring KV transfers --------------------------------------------------------------------


def _layers(engine, blocks: int) -> list[tuple]:
    """The payload: each layer's keys and values of the first ``blocks`` blocks of the engine's cache
    (the prefill worker's snapshot of a prompt's blocks)."""
    cache = engine.runner.kv_cache
    return [(cache[i, 0, :blocks].clone(), cache[i, 1, :blocks].clone()) for i in engine.runner.groups.layer_slot]


def send_layers(session, layers) -> None:
    """Each layer's keys and values into an open transfer session from its first block, then the commit
    (the prefill worker's export order)."""
    for i, (k, v) in enumerate(layers):
        session.send_layer(i, 0, k, v)
    session.commit()


async def timed_transfer(sender, destination, layers, tokens: int) -> tuple[int, float]:
    """One transfer of ``layers`` (a ``tokens``-token prompt's KV) to a reserved ``destination`` (a
    ReserveResponse) by ``sender`` (any backend's): the layers sent from a thread, as the prefill worker's
    export thread sends. (bytes sent, seconds from open to the destination's answer); raises if it failed."""
    from pdserve.kvtransfer.base import KVLayout

    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    session = sender.open(destination, KVLayout.from_proto(destination.layout), tokens)
    await loop.run_in_executor(None, send_layers, session, layers)
    ok, error = await asyncio.wrap_future(session.done)
    elapsed = time.perf_counter() - start
    if not ok:
        raise RuntimeError(f"transfer of {tokens} tokens failed: {error}")
    return session.sent_bytes, elapsed


def timed_local_transfer(hub, address: str, receiver, layout, layers, tokens: int, handle: str) -> tuple[int, float]:
    """One in-process hand-over (the local backend) of ``layers`` into ``receiver``'s first blocks, registered
    on ``hub`` at ``address``: (bytes sent, seconds); raises if it failed."""
    from types import SimpleNamespace

    from pdserve.kvtransfer.local import LocalSender

    receiver.expect(handle, list(range(-(-tokens // layout.block_size))), 0, tokens, 60.0)
    try:
        start = time.perf_counter()
        session = LocalSender(hub).open(SimpleNamespace(kv_address=address, handle=handle), layout, tokens)
        send_layers(session, layers)
        ok, error = session.done.result()
        elapsed = time.perf_counter() - start
    finally:
        receiver.release(handle)
    if not ok:
        raise RuntimeError(f"local transfer of {tokens} tokens failed: {error}")
    return session.sent_bytes, elapsed


async def _grpc_transfers(engine, sizes: list[int], reps: int) -> list[tuple[int, float]]:
    """Ship each size ``reps`` times to a real decode worker server in this process (127.0.0.1),
    sent from a thread as the prefill worker's export thread sends; timed from open to the answer."""
    import grpc

    from pdserve.decode_worker.server import DecodeServicer
    from pdserve.kvtransfer.grpc_backend import GrpcSender
    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
    from pdserve.worker.config import WorkerConfig
    from pdserve.worker.server import WorkerServer

    server = WorkerServer(engine, WorkerConfig(port=0), DecodeServicer)
    await server.start()
    sender, points = GrpcSender(asyncio.get_running_loop()), []
    greedy = pb.SamplingParams(temperature=0, top_p=1, max_tokens=1, ignore_eos=True, repetition_penalty=1)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            for tokens in sizes:
                layers = _layers(engine, -(-tokens // engine.block_size))
                for rep in range(reps + 1):  # the first of each size warms the channel up
                    rid = f"profile-kv-{tokens}-{rep}"
                    res = await stub.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=[7] * tokens,
                                                               sampling=greedy, lease_ms=60_000))
                    try:
                        point = await timed_transfer(sender, res, layers, tokens)
                    finally:
                        await stub.Abort(pb.AbortRequest(request_ids=[rid]))
                    if rep:
                        points.append(point)
    finally:
        await server.stop(0)
    return points


@contextlib.contextmanager
def _pinned(cpus: set[int]):
    """Every thread of this process on ``cpus`` (threads started meanwhile inherit it), as it was after."""
    saved = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # (a thread that ended since)
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for tid, mask in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)


def export_cpus(threads: int) -> tuple[set[int], bool]:
    """Where ``_export_slowdown`` runs the engine (as many CPUs as its threads, of this process's) and
    whether others are left for the sink, as a prefill worker's engine and sender share its cores and a
    decode worker has its own."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) > threads:
        return set(allowed[:threads]), True
    return set(allowed), False


def _export_slowdown(engine, sizes: list[int], reps: int, seed: int = 0) -> tuple[list[tuple[int, float]], str]:
    """How much longer a prompt's step takes when the engine ships its KV over gRPC as a prefill worker
    does (``KVExporter``: each layer's blocks snapshot and sent from the export thread while the next
    layers compute) to a KV sink in a process of its own (``kv_sink``): (bytes shipped, extra seconds) per
    size, the median of ``reps`` steps each way, interleaved, and where it ran. One-step prompts (each size
    within the step budget), fresh token ids. This process's threads (the sender's, started here, too) run
    on as many CPUs as the engine has threads, the sink on the others where there are any."""
    import statistics
    import threading

    import torch

    from pdserve.bench.kv_sink import Sink
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvtransfer.base import KVLayout
    from pdserve.kvtransfer.grpc_backend import GrpcSender
    from pdserve.prefill_worker.export import Export, KVExporter
    from pdserve.proto.v1 import worker_pb2 as pb

    cfg, rng = engine.model_config, random.Random(seed)
    layout = KVLayout(engine.loaded.fingerprint, engine.config.dtype, engine.block_size, cfg.num_layers,
                      cfg.num_kv_heads, cfg.head_dim)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    points, count = [], 0

    def step_s(tokens: int, address: str | None) -> float:
        nonlocal count
        count += 1
        rid, session = f"profile-export-{count}", None
        if address is not None:
            destination = pb.ReserveResponse(handle=rid, kv_address=address, layout=layout.to_proto(pb))
            session = sender.open(destination, layout, tokens)
            exporter.add(rid, Export(session, 0, tokens))
        engine.add_request(rid, [rng.randrange(100, cfg.vocab_size) for _ in range(tokens)], params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        elapsed = time.perf_counter() - start
        if session is not None:
            ok, error = session.done.result(120)
            if not ok:
                raise RuntimeError(f"shipping {tokens} tokens' KV to the sink failed: {error}")
        return elapsed

    cpus, spare = export_cpus(torch.get_num_threads())
    where = (f"this process on CPU {sorted(cpus)}, the sink on the others" if spare
             else "the sink on the engine's CPUs (no other was free: an overestimate)")
    pinning = _pinned(cpus) if spare else contextlib.nullcontext()
    with pinning, Sink(avoid=cpus if spare else set()) as address:
        # started here, so that their threads (and gRPC's) share the engine's CPUs
        loop = asyncio.new_event_loop()  # the worker's: the sessions' streams run on it
        looping = threading.Thread(target=loop.run_forever, name="profile-export-loop", daemon=True)
        looping.start()
        exporter = KVExporter(engine.runner, engine.block_size, cfg.num_layers)
        try:
            sender = GrpcSender(loop)
            for tokens in sizes:
                step_s(tokens, None), step_s(tokens, address)  # warm: the shape, the channel
                alone, shipping = [], []
                for _ in range(reps):
                    alone.append(step_s(tokens, None))
                    shipping.append(step_s(tokens, address))
                extra = statistics.median(shipping) - statistics.median(alone)
                points.append((tokens * cfg.kv_bytes_per_token(engine.runner.kv_cache.element_size()), extra))
        finally:
            exporter.close()
            engine.runner.layer_hook = None
            loop.call_soon_threadsafe(loop.stop)
            looping.join(10)
            loop.close()
    return points, where


def export_sizes(quick: bool, budget: int) -> list[int]:
    """Prompt sizes whose step slowdown when shipping their KV is measured: one step each."""
    return [n for n in ((256,) if quick else (512, 2048)) if n <= budget] or [budget]


def _local_transfers(engine, sizes: list[int], reps: int) -> list[tuple[int, float]]:
    """In-process hand-over into a receiver's cache (the local backend)."""
    import torch

    from pdserve.kvtransfer.base import KVLayout
    from pdserve.kvtransfer.local import LocalHub
    from pdserve.kvtransfer.receiver import KVReceiver

    cfg, cache = engine.model_config, engine.runner.kv_cache
    layout = KVLayout(engine.loaded.fingerprint, engine.config.dtype, engine.block_size, cfg.num_layers,
                      cfg.num_kv_heads, cfg.head_dim)
    points = []
    for tokens in sizes:
        blocks = -(-tokens // engine.block_size)
        layers = _layers(engine, blocks)
        hub = LocalHub()
        receiver = KVReceiver(torch.empty((cfg.num_layers, 2, blocks, *cache.shape[3:]), dtype=cache.dtype), layout)
        hub.register("local://profile", receiver)
        for rep in range(reps + 1):
            point = timed_local_transfer(hub, "local://profile", receiver, layout, layers, tokens, f"x{rep}")
            if rep:
                points.append(point)
    return points


def fit_transfer(points: list[tuple[int, float]]) -> TransferModel:
    """seconds = overhead + bytes x s_per_byte, least squares, both kept non-negative."""
    import numpy as np

    x = np.array([b for b, _ in points], dtype=float)
    y = np.array([t for _, t in points])
    slope, intercept = np.polyfit(x, y, 1) if len(set(x)) > 1 else (float(y.mean() / x.mean()), 0.0)
    if intercept < 0:
        slope, intercept = float((x @ y) / (x @ x)), 0.0  # through the origin
    if slope < 0:
        slope, intercept = 0.0, float(y.mean())
    return TransferModel(float(intercept), float(slope))


def measure_transfers(engine, backends: list[str], sizes: list[int], reps: int = 3,
                      export_prompts: list[int] = ()) -> tuple[dict[str, TransferModel], dict]:
    """A TransferModel per measurable backend, and a note per backend about how (or why not); on a CPU
    engine with ``export_prompts`` (prompt sizes), grpc's export slowdown of the engine's steps too
    (``_export_slowdown``; kept non-negative: on a busy machine a difference of medians can be)."""
    models, notes = {}, {}
    for backend in backends:
        if backend in UNMEASURED_BACKENDS:
            notes[backend] = "not measured: " + UNMEASURED_BACKENDS[backend]
            continue
        export = TransferModel(0.0, 0.0)
        if backend == "grpc":
            points = asyncio.run(_grpc_transfers(engine, sizes, reps))
            notes[backend] = "to a decode worker server in this process over 127.0.0.1"
            if engine.config.device == "cpu" and export_prompts:  # the sender shares the engine's cores
                slowdown, where = _export_slowdown(engine, list(export_prompts), reps + 2)
                fitted = fit_transfer(slowdown)
                export = TransferModel(max(fitted.overhead_s, 0.0), max(fitted.s_per_byte, 0.0))
                notes[backend] += ("; a step shipping its KV to a sink in another process, over the same step "
                                   "alone: " + ", ".join(f"{b / 1e6:.1f} MB +{1e3 * t:.0f} ms" for b, t in slowdown)
                                   + f" ({where})")
        else:
            points = _local_transfers(engine, sizes, reps)
            notes[backend] = "in-process copies into a receiver's cache"
        models[backend] = dataclasses.replace(fit_transfer(points), export_step_overhead_s=export.overhead_s,
                                              export_step_s_per_byte=export.s_per_byte)
        notes[backend] += f"; {len(points)} transfers of {min(sizes)}-{max(sizes)} tokens"
    return models, notes


# ---- a request's time outside engine steps -----------------------------------------------------

OVERHEAD_PROMPT = 16  # tokens of the short prompts: their step is a small, well-predicted part of their TTFT


def measure_request_overhead(profile: Profile, url: str, samples: int = 8, seed: int = 0) -> tuple[float, dict]:
    """A request's time outside engine steps before its first token, through the server at ``url``: the
    median TTFT of ``samples`` prompts of ``OVERHEAD_PROMPT`` random tokens (one output token, one at a
    time, after a warm-up) less ``profile``'s step for such a prompt; never below 0. Returns it (seconds)
    and what was measured."""
    import statistics

    from pdserve.bench.api import run_bench
    from pdserve.bench.config import BenchConfig

    config = BenchConfig(base_url=url, progress=False, dataset_name="random", random_input_len=OVERHEAD_PROMPT,
                         random_output_len=1, num_prompts=samples, max_concurrency=1, warmup_requests=1,
                         seed=seed)
    run = asyncio.run(run_bench(config)).runs[0]
    ttfts = [r.ttft for r in run["records"] if r.ok and not r.warmup and r.ttft is not None]
    if not ttfts:
        errors = sorted({r.error for r in run["records"] if r.error})
        raise RuntimeError(f"--serving-url {url}: no request got a first token ({', '.join(errors) or 'none sent'})")
    step = profile.step_s(StepFeatures(OVERHEAD_PROMPT, chunk_pairs(0, OVERHEAD_PROMPT)))
    ttft = statistics.median(ttfts)
    details = {"url": url, "requests": len(ttfts), "prompt_tokens": OVERHEAD_PROMPT, "median_ttft_s": ttft,
               "predicted_step_s": step}
    return max(ttft - step, 0.0), details


def with_request_overhead(profile: Profile, url: str, samples: int = 8, seed: int = 0) -> Profile:
    """``profile`` with its request overhead measured through ``url`` (``measure_request_overhead``)."""
    overhead, details = measure_request_overhead(profile, url, samples, seed)
    return dataclasses.replace(profile, request_overhead_s=overhead, fit={**profile.fit, "request_overhead": details})


# ---- what it ran on ----------------------------------------------------------------------------


def hardware_info(engine) -> dict:
    import torch

    from pdserve.engine.cpu_isa import cpu_flags, describe_cpu

    relevant = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    info = {"cpu": describe_cpu().split(",")[0], "cpu_flags": relevant, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
            "device": engine.config.device}
    if engine.cpu_plan is not None:
        info.update(isa=engine.cpu_plan.isa, linear_path=engine.cpu_plan.linear_path_for(engine.runner.dtype))
    return info


def model_info(engine) -> dict:
    cfg, config = engine.model_config, engine.config
    dtype_bytes = engine.runner.kv_cache.element_size()
    return {"name": engine.model_name, "spec": config.model, **{k: getattr(cfg, k) for k in SHAPE_FIELDS},
            "parameters": cfg.num_params, "dtype": config.dtype, "kv_cache_dtype": config.kv_cache_dtype,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(dtype_bytes),
            "block_size": config.block_size, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": engine.max_model_len}


# ---- the profiles ------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def build_engine(config: ProfileConfig):
    """The engine to measure, sized for the plan: (engine, its waves, the transfer sizes)."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.loader import load_model

    loaded = load_model(config.model_spec, dtype=getattr(torch, config.dtype), progress=False, seed=config.seed)
    max_len = loaded.config.max_position_embeddings
    waves = step_plan(config.budget, max_len, config.quick)
    sizes = transfer_sizes(config.quick, max_len)
    tokens = max([w.tokens for w in waves] + sizes)
    blocks = 2 * -(-tokens // BLOCK_SIZE) + 64  # the largest wave's (or transfer's) blocks, twice, and some
    engine_config = EngineConfig(model=config.model_spec, dtype=config.dtype, num_threads=config.num_threads,
                                 max_num_batched_tokens=config.budget, max_num_seqs=64, block_size=BLOCK_SIZE,
                                 num_kv_blocks=blocks, enable_prefix_caching=False, load_progress=False,
                                 seed=config.seed)
    engine = LLMEngine(engine_config, loaded=loaded)
    return engine, waves, sizes


def transfer_sizes(quick: bool, max_len: int) -> list[int]:
    return [n for n in ((256, 4096) if quick else (64, 512, 2048, 4096)) if n < max_len - 1]


def measure(config: ProfileConfig, progress: bool = True) -> tuple[Profile, list[StepSample]]:
    """Measure this machine: the profile, and the step samples it was fitted on."""
    engine, waves, sizes = build_engine(config)
    started = time.perf_counter()
    samples = measure_steps(engine, waves, config.max_seconds, config.seed, progress)
    step_seconds = time.perf_counter() - started
    step, fit = fit_with_holdout(samples, config.seed)
    transfer, notes = measure_transfers(engine, config.backends, sizes, reps=2 if config.quick else 3,
                                        export_prompts=export_sizes(config.quick, config.budget))
    fit.update(measured_seconds=round(step_seconds, 1), transfer=notes,
               note="steps timed from schedule to outputs (LLMEngine.step); holdout: the same fit on 80% "
                    "of the steps, predicting the other 20%")
    profile = Profile("measured", model_info(engine), hardware_info(engine), step, transfer, fit, _now())
    return profile, samples


def roofline_profile(config: ProfileConfig) -> Profile:
    """A modelled profile: the roofline of ``config.roofline``'s hardware for ``config.shape``."""
    shape = dataclasses.asdict(PRESETS[config.shape])
    profile = roofline(HARDWARE[config.roofline], shape, config.shape)
    return dataclasses.replace(profile, created=_now())
