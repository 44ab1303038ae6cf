"""The OpenAI-compatible HTTP API in front of the workers.

A request's path: its API key, when keys are configured (401; router/auth.py: the tenant, whose
cache salt the request gets) -> body within the limit (413, router/asgi.py) -> validate (pydantic;
400 naming the field) -> the model, by name or alias (404 naming the served ones; router/models.py)
-> admission (429 with Retry-After) -> chat template and tokenizer -> context check (400
context_length_exceeded) -> one worker request per choice, dispatched among that model's workers
(router/dispatcher.py: colocated or disaggregated, retries, migration; 503 when no worker is up)
-> stream (SSE) or collect -> usage. A client that goes away cancels its worker calls, which
aborts the requests there. A large body is parsed and tokenised on a thread, so no
single request holds the event loop (``/health`` answers throughout).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import time
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from pdserve.configs import ConfigError, doc
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.admission import TIER_CLASS, Admission, Refused
from pdserve.router.asgi import body_limit, header, read_body, send_json, send_sse
from pdserve.router.auth import OPEN, AuthConfig, Authenticator, Tenant, Unauthorized
from pdserve.router.budgets import Budgets, RateLimited, Reservation
from pdserve.router.cascade import CascadeConfig, Score, accepts, rounded
from pdserve.router.cost import CostModel
from pdserve.router.discovery import StoreDiscovery
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.index_feed import PrefixIndexFeed
from pdserve.router.metrics import RouterMetrics
from pdserve.router.models import ModelWorkers, ServedModel
from pdserve.router.openapi import document_plain_routes
from pdserve.router.policy import POLICIES, DisaggregationConfig
from pdserve.router.pool import WorkerPool
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    field_of_engine_error,
    parse_body,
    parse_tokenize,
    validation_error,
)
from pdserve.router.responses import SSE_DONE, Choice, Formatter, cached_prompt_tokens, usage
from pdserve.router.route_share import RouteShare
from pdserve.router.tokenization import detokenize, tokenize
from pdserve.router.worker_client import NoWorkerError, QueueTimeoutError, WorkerLostError, sampling_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SLOConfig:
    """A service class's latency objective, per request: both must hold (p90 attainment is the share met)."""

    ttft_ms: float = doc(1000.0, "time to first token, milliseconds")
    tpot_ms: float = doc(100.0, "time per output token of every choice (2+ tokens), milliseconds")

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ConfigError(f"ttft_ms and tpot_ms: must be positive, got {self.ttft_ms} and {self.tpot_ms}")

    def met(self, ttft_s: float | None, tpots_s: list[float]) -> bool:
        return ttft_s is not None and ttft_s * 1000 <= self.ttft_ms and all(t * 1000 <= self.tpot_ms for t in tpots_s)


@dataclass(frozen=True)
class RouterConfig:
    """The router's knobs. Every field is a ``--flag`` of ``pdserve router`` and ``pdserve serve``."""

    host: str = doc("127.0.0.1", "address the HTTP API listens on")
    port: int = doc(8000, "HTTP port of the OpenAI-compatible API")
    served_model_name: str = doc("", "one model: the name clients send (default: the name the workers serve); "
                                     "several: each is named by its entry under models:")
    policy: Literal["cache_aware", "least_loaded", "round_robin", "random"] = doc(
        "cache_aware", "how a worker is chosen: cache_aware (least predicted seconds: the prompt's uncached part, "
                       "the queue ahead, the decode slowdown; router/cost.py), least_loaded, round_robin, random")
    cost_prefill_tokens_per_s: float = doc(500.0, "cost model: prompt tokens a worker prefills per second, "
                                                "until its load snapshot carries its own measurement")
    cost_decode_step_s: float = doc(0.02, "cost model: one decode step of one sequence, in seconds (a worker "
                                          "measured slower, from its generation rate, counts as slower)")
    cost_decode_step_s_per_seq: float = doc(0.002, "cost model: seconds each more sequence adds to a decode step")
    cost_transfer_s_per_token: float = doc(5e-5, "cost model: seconds to ship one token's KV to a decode worker")
    cost_remote_overhead_s: float = doc(0.005, "cost model: the extra calls of a remote prefill, in seconds")
    cost_decode_horizon_tokens: int = doc(16, "cost model: output tokens over which a decode slowdown is counted")
    cost_interference: float = doc(2.0, "cost model: weight of a local prefill's delay to its decode batch "
                                        "(higher: more remote prefill)")
    cost_contention: bool = doc(True, "cost model: a remote prefill on a prefill worker that contends with the "
                                      "decode worker for compute (the same GPU, or oversubscribed shared CPUs, as "
                                      "the workers describe themselves) delays that worker's batch as a local one "
                                      "would; off: every worker counts as on hardware of its own")
    recent_routes_s: float = doc(5.0, "cache_aware: for this long, a prompt's blocks count as held where this router "
                                      "sent it (the workers' KV events reach the index a heartbeat or more later); "
                                      "without a state store, the only prefix knowledge, kept until newer routes "
                                      "push it out; 0: off")
    share_routes: bool = doc(True, "cache_aware with a state store: publish this router's routes through the "
                                   "store and count the other routers' as its own for recent_routes_s (as "
                                   "Dynamo's router replica sync), so routers behind one load balancer send a "
                                   "shared prefix to one worker")
    policy_temperature: float = doc(0.0, "cache_aware: 0 picks the least cost (ties at random); above 0, a softmax "
                                         "over -cost / temperature spreads requests over near-equal workers")
    max_concurrent_requests: int = doc(512, "admission limit: past this many sequences in flight (each request's "
                                            "prompts x n; one being tokenised counts one), answer 429")
    retry_after_s: int = doc(1, "Retry-After seconds sent with a 429")
    queue_size: int = doc(0, "requests that may wait, in all service classes together, when max_concurrent_requests "
                             "is reached (priority first, then default, then flex; a full queue sheds flex first); "
                             "0: answer 429 at once")
    queue_timeout_s: float = doc(30.0, "how long a request may wait in the queue before its 429; also how long it "
                                       "may then wait unstarted in a worker's queue on workers scheduling by "
                                       "priority (where later requests of a higher class go ahead of it)")
    poll_interval_s: float = doc(0.5, "how often worker load snapshots and health are read")
    disagg_min_prompt_tokens: int = doc(128, "prompts shorter than this are prefilled on the decode worker "
                                              "(conditional disaggregation)")
    disagg_min_uncached_tokens: int = doc(64, "prompts whose part not cached on the decode worker is shorter "
                                               "than this are prefilled there too")
    max_body_bytes: int = doc(0, "largest request body accepted; a larger one is answered 413 before it is read "
                                 "(0: from the context length, max(1 MiB, max_model_len x 128 B + 64 KiB))")
    max_batch: int = doc(1024, "most completions one request may ask for (prompts x n); past it, a 400")
    startup_wait_s: float = doc(60.0, "how long a request waits for a decode worker when none is in rotation "
                                      "(the first still starting) before a 503; /ready answers 503 meanwhile")
    slo: dict[str, SLOConfig] = doc(default_factory=dict, help="per service class (priority, default, flex): its "
                                                               "ttft_ms and tpot_ms; pdserve_router_slo_requests "
                                                               "counts requests that met it (YAML only)")
    stream_idle_timeout_s: float = doc(60.0, "a worker stream that sends nothing for this long after its first "
                                             "token is given up: the request continues on another decode worker")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.slo) - set(TIER_CLASS))
        if unknown:
            raise ConfigError(f"router.slo: {unknown} are not service classes; allowed: {list(TIER_CLASS)}")

    def cost_model(self) -> CostModel:
        return CostModel(self.cost_prefill_tokens_per_s, self.cost_decode_step_s, self.cost_decode_step_s_per_seq,
                         self.cost_transfer_s_per_token, self.cost_remote_overhead_s, self.cost_decode_horizon_tokens,
                         self.cost_interference, self.policy_temperature, self.cost_contention)


# Bodies up to this size are parsed and tokenised on the event loop (a millisecond or two); larger
# ones on a thread, so that no single request holds the loop (tokenizers releases the GIL there).
_INLINE_BODY_BYTES = 2048


class _Model:
    """One served model in a router: its workers (a view of the shared pool), tokenizer, dispatcher."""

    def __init__(self, served: ServedModel, workers: ModelWorkers, dispatcher: Dispatcher, fixed_name: str):
        self.served, self.workers, self.dispatcher = served, workers, dispatcher
        self.tokenizer = served.tokenizer
        self.fixed_name = fixed_name  # "" (one model, unnamed): as its workers report it

    @property
    def name(self) -> str:
        if self.fixed_name:
            return self.fixed_name
        info = self.workers.model_info()
        return info.model if info else self.served.spec

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.served.aliases)

    @property
    def max_model_len(self) -> int | None:
        info = self.workers.model_info()
        return info.max_model_len if info else None

    def cards(self) -> list[dict]:
        """Its /v1/models entries: the name, then each alias (``parent``: the name)."""
        card = {"id": self.name, "object": "model", "created": 0, "owned_by": "pdserve", "root": self.served.spec,
                "parent": None, "max_model_len": self.max_model_len}
        return [card, *({**card, "id": alias, "parent": self.name} for alias in self.served.aliases)]


class Router:
    """``models``: what it serves (several must each be named), their workers all in ``pool``
    (router/models.py); ``wakers``: scale from zero, per model name; ``cascades``: virtual models
    over them (router/cascade.py)."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, models: list[ServedModel],
                 discovery: StoreDiscovery | None = None, wakers: dict | None = None,
                 auth: Authenticator | None = None, cascades: dict[str, CascadeConfig] | None = None):
        if not models:
            raise ConfigError("a router needs at least one model to serve")
        if len(models) > 1 and (config.served_model_name or not all(m.name for m in models)):
            raise ConfigError("several models: each is named by its entry under models:, not by "
                              "router.served_model_name")
        self.config = config
        self.auth = auth or Authenticator(AuthConfig())  # no keys: open (the router listens on loopback)
        self.budgets = Budgets(self.auth.limits)  # per tenant, reserved at admission
        self.pool = pool  # every model's workers
        self.discovery = discovery  # workers joining and leaving through the state store
        self.metrics = RouterMetrics()
        self._gauged_workers: set[str] = set()  # workers with per-worker gauges exported now
        # The global prefix index, fed by the workers' KV events through the state store (none
        # without one: --worker addresses alone publish nowhere, and cache_aware knows only where
        # it sent recent prompts). Keyed by worker: one index serves every model.
        self.prefix_index = PrefixIndex()
        self.index_feed = (PrefixIndexFeed(self.prefix_index, discovery.store, pool, self.metrics)
                           if discovery is not None else None)
        disaggregation = DisaggregationConfig(config.disagg_min_prompt_tokens, config.disagg_min_uncached_tokens)
        # Without a state store no event ever confirms or corrects a route: remember them until
        # newer ones push them out (RecentRoutes.max_keys blocks).
        recent_s = config.recent_routes_s if discovery is not None else math.inf
        if config.policy != "cache_aware" or config.recent_routes_s <= 0:
            recent_s = None
        # This router's routes, to and from the other routers through the store (router/route_share.py)
        self.route_share = (RouteShare(discovery.store, {}, self.metrics)
                            if discovery is not None and recent_s is not None and config.share_routes else None)
        self.models: list[_Model] = []
        for served in models:
            key = served.name if len(models) > 1 else ""
            workers = ModelWorkers(pool, key)
            decode_policy, prefill_policy = POLICIES[config.policy](config.cost_model())
            dispatcher = Dispatcher(workers, decode_policy, prefill_policy, disaggregation,
                                    self.metrics, waker=(wakers or {}).get(served.name),
                                    wait_for_worker_s=config.startup_wait_s,
                                    stream_idle_timeout_s=config.stream_idle_timeout_s, index=self.prefix_index,
                                    cost_model=config.cost_model(), recent_routes_s=recent_s,
                                    on_route=partial(self.route_share.note, key) if self.route_share else None)
            if self.route_share is not None:
                self.route_share.recents[key] = dispatcher.recent
            self.models.append(_Model(served, workers, dispatcher, served.name or config.served_model_name))
        self.cascades = dict(cascades or {})  # virtual models: router/cascade.py
        for name, cascade in self.cascades.items():
            if any(name in m.names for m in self.models):
                raise ConfigError(f"cascades.{name}: the name is a served model's")
            for stage in cascade.stages:
                if not any(stage in m.names for m in self.models):
                    raise ConfigError(f"cascades.{name}.stages: {stage!r} is not a served model "
                                      f"({', '.join(n for m in self.models for n in m.names)})")
        self.admission = Admission(config.max_concurrent_requests, config.queue_size, config.queue_timeout_s)
        self._executor = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                            thread_name_prefix="router-prepare")

    def model(self, name: str | None) -> _Model:
        """The served model a request names (by its name or an alias; none: the only one); 404 otherwise."""
        if name is None and len(self.models) == 1:
            return self.models[0]
        for m in self.models:
            if name in m.names:
                return m
        if name in self.cascades:  # (tokenize, detokenize: as its first stage does)
            return self.model(self.cascades[name].stages[0])
        served = [n for m in self.models for n in m.names]
        if name is None:
            raise OpenAIError(400, f"model: required when several models are served: "
                                   f"{', '.join(map(repr, served))}", param="model")
        served += list(self.cascades)
        raise OpenAIError(404, f"model {name!r} does not exist; served: {', '.join(map(repr, served))}",
                          type="not_found_error", param="model", code="model_not_found")

    @property
    def body_limit(self) -> int:
        # read before the body names its model: the largest of theirs
        return max(body_limit(m.max_model_len, self.config.max_body_bytes) for m in self.models)

    async def _off_loop(self, size: int, fn: Callable, *args):
        """``fn(*args)`` here for a small body, on a thread for a large one (the loop keeps serving)."""
        if size <= _INLINE_BODY_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- the app ----------------------------------------------------------------------------

    def create_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app):
            await self.pool.start()
            if self.discovery is not None:
                await self.discovery.start()
            if self.index_feed is not None:
                await self.index_feed.start()
            if self.route_share is not None:
                await self.route_share.start()
            # Everything alive now lives as long as the router: keep it out of the collector's
            # full passes, which otherwise pause the event loop for tens of ms (seen as TTFT p99).
            gc.collect()
            gc.freeze()
            yield
            if self.route_share is not None:
                await self.route_share.close()
            if self.index_feed is not None:
                await self.index_feed.close()
            if self.discovery is not None:
                await self.discovery.close()
            await self.pool.close()
            self._executor.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="pdserve", version="1", lifespan=lifespan)
        document_plain_routes(app)  # in /openapi.json only: asgi() below serves them
        app.state.prefix_index = self.prefix_index
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(OpenAIError, self._openai_error)

        @app.get("/v1/models")
        async def models():
            cascades = [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve", "root": None,
                         "parent": None, "stages": c.stages} for name, c in self.cascades.items()]
            return {"object": "list", "data": [card for m in self.models for card in m.cards()] + cascades}

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/ready")
        async def ready():
            ok, reason = self.readiness()
            contention = self.pool.contention()  # what each says it computes on, and whom it contends with
            workers = [{"address": w.address, "worker_id": w.worker_id, "role": w.info.role if w.info else None,
                        "healthy": w.healthy, "compute": w.info.compute if w.info else None,
                        "contends_with": sorted(contention.get(w.worker_id, ()))} for w in self.pool.workers]
            return JSONResponse({"ready": ok, "reason": reason, "workers": workers}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            self._refresh_worker_gauges()
            return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

        plain = {"/v1/chat/completions": partial(self._generate, "chat", ChatCompletionRequest),
                 "/v1/completions": partial(self._generate, "completions", CompletionRequest),
                 "/tokenize": self._tokenize, "/detokenize": self._detokenize}

        async def asgi(scope, receive, send):
            tenant = OPEN
            if scope["type"] == "http" and self.auth.needs_key(scope["path"]):
                try:
                    tenant = self.auth.tenant(header(scope, b"authorization"))
                except Unauthorized as e:
                    await self._send_error(scope, send, OpenAIError(
                        401, str(e), type="invalid_request_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"}))
                    return
            # The endpoints that take a body are served as plain ASGI: per streamed token, the
            # framework's middleware stack cost as much as the rest of the router together, and
            # bodies are read within the limit and parsed off the loop (router/asgi.py).
            if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in plain:
                await self._plain_endpoint(plain[scope["path"]], scope, receive, send, tenant)
            else:
                await app(scope, receive, send)

        asgi.fastapi = app
        return asgi

    async def _validation_error(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        self.metrics.errors.labels("invalid_request").inc()
        self.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error.body(), status_code=400)

    async def _openai_error(self, request: Request, exc: OpenAIError) -> JSONResponse:
        self.metrics.errors.labels(exc.code or exc.type).inc()
        self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def _plain_endpoint(self, handler, scope, receive, send, tenant: Tenant) -> None:
        """Read the body (within the limit), answer with ``handler(body, tenant)``: JSON, or SSE to stream."""
        try:
            raw = await read_body(scope, receive, self.body_limit)
            answer = await handler(raw, tenant)
        except OpenAIError as e:
            await self._send_error(scope, send, e)
            return
        headers = self.budgets.headers(tenant.name)  # OpenAI's x-ratelimit-* on every answer, as of now
        if isinstance(answer, dict):
            await send_json(send, 200, answer, headers)
        else:
            await send_sse(send, receive, answer, headers)

    async def _send_error(self, scope, send, e: OpenAIError) -> None:
        self.metrics.errors.labels(e.code or e.type).inc()
        self.metrics.requests.labels(scope["path"], str(e.status)).inc()
        await send_json(send, e.status, e.body(), e.headers)

    def _refresh_worker_gauges(self) -> None:
        m = self.metrics
        per_worker = (m.worker_running, m.worker_waiting, m.worker_kv_usage, m.worker_tps)
        in_rotation = self.pool.healthy()
        m.workers_healthy.set(len(in_rotation))
        listed = {w.worker_id for w in in_rotation}
        # A worker out of rotation or gone shows nothing: its last snapshot (say a request running)
        # is no longer polled and would otherwise stay here for good.
        for gone in self._gauged_workers - listed:
            for gauge in per_worker:
                gauge.remove(gone)
        self._gauged_workers = listed
        for w in in_rotation:
            s = w.snapshot or pb.LoadSnapshot()
            m.worker_running.labels(w.worker_id).set(s.num_running)
            m.worker_waiting.labels(w.worker_id).set(s.num_waiting)
            m.worker_kv_usage.labels(w.worker_id).set(s.kv_usage)
            m.worker_tps.labels(w.worker_id).set(s.generation_tokens_per_s)

    # ---- serving ----------------------------------------------------------------------------

    async def _generate(self, kind: str, model, raw: bytes, tenant: Tenant) -> dict | AsyncIterator[bytes]:
        started = time.perf_counter()
        body = await self._off_loop(len(raw), parse_body, model, raw)
        return await self._serve(kind, body, len(raw), started, tenant)

    async def _tokenize(self, raw: bytes, _tenant: Tenant) -> dict:
        body = await self._off_loop(len(raw), parse_tokenize, raw)
        model = self.model(body.model)
        answer = await self._off_loop(len(raw), tokenize, model.tokenizer, body, model.max_model_len)
        self.metrics.requests.labels("/tokenize", "200").inc()
        return answer

    async def _detokenize(self, raw: bytes, _tenant: Tenant) -> dict:
        body = await self._off_loop(len(raw), parse_body, DetokenizeRequest, raw)
        answer = await self._off_loop(len(raw), detokenize, self.model(body.model).tokenizer, body)
        self.metrics.requests.labels("/detokenize", "200").inc()
        return answer

    def readiness(self) -> tuple[bool, str]:
        """Ready when every model is (readiness below); the reason names a model that is not."""
        answers = [(m, *readiness(m.workers, m.dispatcher.waker)) for m in self.models]
        if len(answers) == 1:
            return answers[0][1:]
        waiting = [(m, reason) for m, ok, reason in answers if not ok]
        if waiting:
            return False, "; ".join(f"{m.name}: {reason}" for m, reason in waiting)
        return True, f"every model ({', '.join(m.name for m in self.models)}) has a decode worker in rotation"

    async def _admit(self, body: ChatCompletionRequest | CompletionRequest,
                     tenant: Tenant) -> tuple[_Model, str, int]:
        """Before tokenising: the model, the service class the tenant may use, its request budget, then
        room for the request's sequences (waiting in its class's queue). (model, tier, sequences)"""
        model = self.model(body.model)
        tier = service_tier(body, tenant)
        try:
            self.budgets.admit(tenant.name)
        except RateLimited as e:
            raise _rate_limited(e) from None
        sequences = body.n * (len(body.prompts()) if isinstance(body, CompletionRequest) else 1)
        try:
            await self.admission.acquire(sequences, TIER_CLASS[tier])
        except Refused as e:
            self.metrics.errors.labels(f"refused_{tier}").inc()
            raise OpenAIError(429, f"{e}; retry shortly", type="rate_limit_error", code="rate_limit_exceeded",
                              headers={"Retry-After": str(self.config.retry_after_s)}) from None
        return model, tier, sequences

    def _reserve(self, tenant: Tenant, params: SamplingParams, prompts: list[tuple[list[int], str]],
                 sequences: int, limit: int | None) -> Reservation | None:
        """The tenant's tokens (prompt tokens + max_tokens x n; unset: what the context, ``limit``,
        leaves) and sequences, held until the request ends."""
        limit = limit or 0
        tokens = sum(len(ids) + params.n * (params.max_tokens or max(limit - len(ids), 0)) for ids, _ in prompts)
        try:
            return self.budgets.reserve(tenant.name, tokens, sequences)
        except RateLimited as e:
            raise _rate_limited(e) from None

    async def _serve(self, kind: str, body: ChatCompletionRequest | CompletionRequest, size: int,
                     started: float, tenant: Tenant = OPEN) -> dict | AsyncIterator[bytes]:
        """The JSON response, or the SSE body to stream; errors before any output raise OpenAIError."""
        cascade = self.cascades.get(body.model)
        if cascade is not None:
            return await self._cascade(kind, body, size, started, tenant, cascade)
        return await self._serve_model(kind, body, size, started, tenant)

    async def _cascade(self, kind: str, body, size: int, started: float, tenant: Tenant,
                       cascade: CascadeConfig) -> dict | AsyncIterator[bytes]:
        """Each stage in turn until one's answer is accepted (router/cascade.py); the last always is."""
        stages: list[dict] = []
        for stage in cascade.stages[:-1]:
            try:
                held = await self._serve_model(kind, body.model_copy(update={"model": stage}), size, started,
                                               tenant, hold=True)
            except OpenAIError as e:
                if e.status != 503:
                    raise
                # no worker of this stage (its pool down or at zero): the next stage answers
                self.metrics.cascade_stages.labels(self.model(stage).name, "unavailable").inc()
                stages.append({"model": self.model(stage).name, "prompt_tokens": 0, "completion_tokens": 0,
                               "accepted": False, "error": e.code})
                continue
            scores = held.scores()
            info = {"model": held.run.fmt.model, "mean_logprob": rounded(min(s.mean for s in scores)),
                    "min_logprob": rounded(min(s.min for s in scores))}
            if accepts(cascade, scores):
                self.metrics.cascade_stages.labels(held.run.fmt.model, "accepted").inc()
                return await held.release(bool(body.stream), _include_usage(body), stages, {**info, "accepted": True})
            self.metrics.cascade_stages.labels(held.run.fmt.model, "escalated").inc()
            own = await held.settle()
            stages.append({**info, "prompt_tokens": own["prompt_tokens"],
                           "completion_tokens": own["completion_tokens"], "accepted": False})
        last = body.model_copy(update={"model": cascade.stages[-1]})
        return await self._serve_model(kind, last, size, started, tenant, stages=stages)

    async def _serve_model(self, kind: str, body: ChatCompletionRequest | CompletionRequest, size: int,
                           started: float, tenant: Tenant = OPEN, hold: bool = False,
                           stages: list[dict] | None = None) -> dict | AsyncIterator[bytes] | _Held:
        """One served model's answer. ``hold`` (a cascade's stage): the whole answer, with its tokens'
        log-probabilities, not yet sent (_Held); ``stages``: the cascade's earlier ones, for usage."""
        endpoint = f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}"
        model, tier, sequences = await self._admit(body, tenant)  # its sequences are held from here to its end
        reservation = None
        self.metrics.in_flight.inc()
        stream = None
        try:
            params, prompts = await self._off_loop(size, self._prepare, kind, body, model)
            params = params.replace(priority=body.priority if body.priority is not None else TIER_CLASS[tier])
            if hold and params.logprobs is None:  # the scorer's input (the answer shows them only if asked)
                params = params.replace(logprobs=0)
            reservation = self._reserve(tenant, params, prompts, sequences, model.max_model_len)
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            choices, requests = self._requests(rid, body, params, prompts, tenant.cache_salt(body.cache_salt),
                                               self.config.queue_timeout_s)
            stream = _merge([model.dispatcher.run(r) for r in requests])
            first = await self._first(stream)  # errors before any output become HTTP statuses
        except BaseException:
            self._done(sequences, reservation, used_tokens=0)
            if stream is not None:
                await stream.aclose()
            raise
        fmt = Formatter(model.tokenizer, rid, model.name, chat=kind == "chat", service_tier=tier)
        want_logprobs = (body.logprobs if kind == "chat" else body.logprobs is not None)
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        run = _Run(self, fmt, choices, want_logprobs, prompt_tokens, started, endpoint, params.n, reservation, tier)
        if stages is not None:
            run.stages, run.stage = stages, {"model": model.name, "accepted": True}
        if hold:
            return await _Held.take(run, first, stream)
        if body.stream:
            body_iter = run.sse(first, stream, _include_usage(body))
            # A client gone before the first byte: the body is never iterated, its finally never
            # runs; this settles the request when the unstarted generator is collected.
            weakref.finalize(body_iter, run.abandon, stream)
            return body_iter
        try:
            return await run.collect(first, stream)
        finally:
            await stream.aclose()

    @staticmethod
    def _requests(rid: str, body, params: SamplingParams, prompts: list[tuple[list[int], str]],
                  cache_salt: str, queue_timeout_s: float) -> tuple[list[Choice], list[pb.GenerateRequest]]:
        """One choice and one worker request per (prompt, sample); ``cache_salt``: the tenant's."""
        choices, requests = [], []
        for p, (ids, prefix) in enumerate(prompts):
            for j in range(params.n):
                index = p * params.n + j
                echo_ids = ids if params.prompt_logprobs is not None else []
                choices.append(Choice(index, prefix=prefix, prompt_ids=echo_ids))
                seed = None if params.seed is None else params.seed + j
                requests.append(pb.GenerateRequest(
                    request_id=f"{rid}-{index}", prompt_token_ids=ids, cache_salt=cache_salt,
                    sampling=sampling_to_proto(params.replace(n=1, seed=seed)), queue_timeout_s=queue_timeout_s))
        return choices, requests

    def _prepare(self, kind: str, body, model: _Model) -> tuple[SamplingParams, list[tuple[list[int], str]]]:
        """Sampling parameters and (prompt ids, echo prefix) per prompt; 400s name the field."""
        try:
            params = body.engine_params()
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), param=field_of_engine_error(e, body)) from e
        if kind == "chat":
            try:
                prompts = [(model.tokenizer.encode_chat(body.template_messages(), body.add_generation_prompt), "")]
            except Exception as e:  # a template may raise on inputs it does not accept
                raise OpenAIError(400, f"messages: cannot apply the chat template: {e}", param="messages") from e
        else:
            if len(body.prompts()) * params.n > self.config.max_batch:
                raise OpenAIError(400, f"prompt: {len(body.prompts())} prompts x n={params.n} is over the "
                                       f"{self.config.max_batch} completions one request may ask for "
                                       f"(--max-batch)", param="prompt")
            prompts = []
            for p in body.prompts():
                ids = model.tokenizer.encode(p) if isinstance(p, str) else list(p)
                echo = (p if isinstance(p, str) else model.tokenizer.decode(ids)) if body.echo else ""
                prompts.append((ids, echo))
        for ids, _ in prompts:
            _check_context(kind, ids, params, model.max_model_len)
        return params, prompts


    async def _first(self, stream):
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None
        except NoWorkerError as e:
            raise OpenAIError(503, f"no worker can serve the request: {e}", type="service_unavailable",
                              code="no_worker_available") from e
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), param=e.field, code=e.code) from e
        except QueueTimeoutError as e:
            raise self._queue_timeout(e) from e

    def _queue_timeout(self, e: QueueTimeoutError) -> OpenAIError:
        """A worker's queue timeout: the 429 the router's own queue would have answered."""
        self.metrics.errors.labels("queue_timeout").inc()
        return OpenAIError(429, f"{e}; retry shortly", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def _done(self, sequences: int, reservation: Reservation | None, used_tokens: int) -> None:
        self.admission.release(sequences)
        self.metrics.in_flight.dec()
        self.budgets.release(reservation, used_tokens)


def _check_context(kind: str, ids: list[int], params: SamplingParams, limit: int | None) -> None:
    field = "messages" if kind == "chat" else "prompt"
    if not ids:
        raise OpenAIError(400, f"{field}: the prompt is empty", param=field)
    if limit is None:
        return
    wanted = len(ids) + (params.max_tokens or 1)
    if len(ids) >= limit or wanted > limit:
        raise OpenAIError(
            400, f"This model's maximum context length is {limit} tokens. However, you requested {wanted} "
            f"tokens ({len(ids)} in the {field}, {params.max_tokens or 1} for the completion).",
            param=field, code="context_length_exceeded")


def service_tier(body: ChatCompletionRequest | CompletionRequest, tenant: Tenant) -> str:
    """The service class a request is served in: its ``service_tier`` (``auto``: default), if its
    tenant may use it, with vLLM's ``priority`` no more urgent than the tenant's best class."""
    tier = "default" if body.service_tier in (None, "auto") else body.service_tier
    allowed = tenant.service_tiers
    if tier not in allowed:
        raise OpenAIError(400, f"service_tier: {tier!r} is not open to this API key; it may use "
                               f"{sorted(allowed, key=TIER_CLASS.get)}", param="service_tier",
                          code="service_tier_not_allowed")
    best = min(TIER_CLASS[t] for t in allowed)
    if body.priority is not None and body.priority < best:
        raise OpenAIError(400, f"priority: {body.priority} is more urgent than this API key's best class ({best}: "
                               f"priority 0, default 1, flex 2; lower is sooner)", param="priority")
    return tier


def _rate_limited(e: RateLimited) -> OpenAIError:
    return OpenAIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded", headers=e.headers)


def readiness(pool: WorkerPool, waker) -> tuple[bool, str]:
    """Whether a request sent now will be served, and why: a decode worker is in rotation, or
    the decode pool is at zero replicas and a request wakes it (scale from zero, on Ray). A
    prefill worker alone serves nothing: every request ends on a decode worker."""
    if pool.healthy("decode"):
        return True, "a decode worker is in rotation"
    if waker is not None and waker.can_wake("decode"):
        return True, "no decode worker in rotation: the pool scales from zero, a request wakes it"
    states = Counter(f"{w.info.role if w.info else 'unknown'} {'in rotation' if w.healthy else 'out of rotation'}"
                     for w in pool.workers)
    known = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none known yet"
    return False, f"no decode worker in rotation (workers: {known})"


class _Run:
    """One HTTP request being answered: its choices, timings and metrics."""

    def __init__(self, router: Router, fmt: Formatter, choices: list[Choice], want_logprobs: bool,
                 prompt_tokens: int, started: float, endpoint: str, n: int = 1,
                 reservation: Reservation | None = None, tier: str = "default"):
        self.router, self.fmt, self.choices = router, fmt, choices
        self.reservation, self.tier = reservation, tier
        self.want_logprobs, self.prompt_tokens = want_logprobs, prompt_tokens
        self.started, self.endpoint, self.n = started, endpoint, n
        # Each choice's prefix hit, from its first message: the worker that computed its prompt
        # (a prefill worker, or its decode worker); later messages (the decode worker after a
        # remote prefill, another after a migration) did not compute the prompt.
        self.cached = [None] * len(choices)
        self.first_at: float | None = None
        self.finished = False
        self.stages: list[dict] | None = None  # a cascade's earlier stages (usage counts them too)
        self.stage: dict = {}  # and this one's entry in usage.stages

    def _record(self, index: int, msg: pb.GenerateResponse) -> tuple[Choice, str, list, int]:
        c = self.choices[index]
        offset = len(c.prefix) + c.text_len
        now = time.perf_counter()
        previous = c.last_token_at
        text, lps = c.add(msg, now)
        if self.cached[index] is None:
            self.cached[index] = msg.num_cached_tokens
        if msg.token_ids:
            m = self.router.metrics
            if self.first_at is None:
                self.first_at = now
                m.ttft.labels(self.fmt.model).observe(now - self.started)
                m.class_ttft.labels(self.tier).observe(now - self.started)
            elif previous is not None:
                m.itl.labels(self.fmt.model).observe(now - previous)
        return c, text, lps, offset

    def _usage(self) -> dict:
        own = usage(self.prompt_tokens, sum(len(c.token_ids) for c in self.choices),
                    cached_prompt_tokens(self.cached, self.n))
        if self.stages is None:
            return own
        stages = [*self.stages, {**self.stage, "prompt_tokens": own["prompt_tokens"],
                                 "completion_tokens": own["completion_tokens"]}]
        total = usage(sum(s["prompt_tokens"] for s in stages), sum(s["completion_tokens"] for s in stages),
                      own["prompt_tokens_details"]["cached_tokens"])
        return {**total, "stages": stages}

    def abandon(self, stream) -> None:
        if self.finished:
            return
        self._finish(499)
        try:
            asyncio.get_running_loop().create_task(stream.aclose())
        except RuntimeError:  # collected outside the event loop: nothing left to cancel
            pass

    def _finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        m, end = self.router.metrics, time.perf_counter()
        m.e2e.labels(self.fmt.model).observe(end - self.started)
        m.requests.labels(self.endpoint, str(status)).inc()
        m.prompt_tokens.labels(self.fmt.model).inc(self.prompt_tokens)
        tpots = []
        for c in self.choices:
            m.generation_tokens.labels(self.fmt.model).inc(len(c.token_ids))
            if len(c.token_ids) > 1 and c.first_token_at is not None:
                tpots.append((c.last_token_at - c.first_token_at) / (len(c.token_ids) - 1))
                m.tpot.labels(self.fmt.model).observe(tpots[-1])
                m.class_tpot.labels(self.tier).observe(tpots[-1])
        slo = self.router.config.slo.get(self.tier)
        if slo is not None:
            ttft = None if self.first_at is None else self.first_at - self.started
            met = status == 200 and slo.met(ttft, tpots)
            m.slo_requests.labels(self.tier, "yes" if met else "no").inc()
        generated = sum(len(c.token_ids) for c in self.choices)
        self.router._done(len(self.choices), self.reservation, self.prompt_tokens + generated)

    async def collect(self, first, stream) -> dict:
        status = 200
        try:
            item = first
            while item is not None:
                self._record(*item)
                item = await _next(stream)
            return self.fmt.response(self.choices, self.want_logprobs, self._usage())
        except WorkerLostError as e:
            status = 502
            raise OpenAIError(502, str(e), type="server_error", code="worker_lost") from e
        except QueueTimeoutError as e:  # one choice of several, after another had output
            status = 429
            raise self.router._queue_timeout(e) from e
        finally:
            self._finish(status)

    async def sse(self, first, stream, include_usage: bool) -> AsyncIterator[bytes]:
        status = 200
        try:
            for c in self.choices:
                if chunk := self.fmt.first_chunk(c.index, c.prefix):
                    yield chunk
            item = first
            while item is not None:
                c, text, lps, offset = self._record(*item)
                # A chunk for every message with tokens, its text empty where the tokens end inside a
                # character (a byte of a multi-byte one): the client sees each token when it comes, its
                # first token included, as vLLM sends it (its completions and chat streams skip a chunk
                # only where no token came)
                if text or lps or c.finish_reason is not None or item[1].token_ids:
                    yield self.fmt.delta_chunk(c, text, lps, self.want_logprobs, offset)
                item = await _next(stream)
            if include_usage:
                yield self.fmt.usage_chunk(self._usage())
            yield SSE_DONE
        except QueueTimeoutError as e:  # one choice of several, after another had output
            status = 429
            yield b"data: " + orjson.dumps(self.router._queue_timeout(e).body()) + b"\n\n" + SSE_DONE
        except (WorkerLostError, NoWorkerError, InvalidRequestError) as e:
            status = 502
            self.router.metrics.errors.labels(type(e).__name__).inc()
            error = OpenAIError(502, str(e), type="server_error")
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n" + SSE_DONE
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            await stream.aclose()
            self._finish(status)


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


class _Held:
    """A cascade stage's whole answer, received and not yet sent: scored, then released to the client
    (its messages replayed through its _Run) or settled (accounted for, and dropped)."""

    def __init__(self, run: _Run, items: list):
        self.run, self.items = run, items

    @staticmethod
    async def take(run: _Run, first, stream) -> _Held:
        items = []
        try:
            item = first
            while item is not None:
                items.append(item)
                item = await _next(stream)
        except WorkerLostError as e:
            run._finish(502)
            raise OpenAIError(502, str(e), type="server_error", code="worker_lost") from e
        except QueueTimeoutError as e:
            run._finish(429)
            raise run.router._queue_timeout(e) from e
        except BaseException:
            run._finish(499)
            raise
        finally:
            await stream.aclose()
        return _Held(run, items)

    def scores(self) -> list[Score]:
        """Each choice's score over its sampled tokens' log-probabilities."""
        per_choice: list[list[float]] = [[] for _ in self.run.choices]
        for index, msg in self.items:
            per_choice[index] += [p.sampled.logprob for p in msg.logprobs]
        return [Score.of(values) for values in per_choice]

    async def _replay(self):
        for item in self.items[1:]:
            yield item

    async def release(self, stream: bool, include_usage: bool, stages: list[dict], stage: dict):
        """The answer, as the client asked for it (JSON, or the SSE body), with the cascade in usage."""
        self.run.stages, self.run.stage = stages, stage
        first = self.items[0] if self.items else None
        if stream:
            replay = self._replay()
            body_iter = self.run.sse(first, replay, include_usage)
            weakref.finalize(body_iter, self.run.abandon, replay)
            return body_iter
        return await self.run.collect(first, self._replay())

    async def settle(self) -> dict:
        """Account for the answer (tokens, metrics, the tenant's budget) without sending it; its usage."""
        return (await self.run.collect(self.items[0] if self.items else None, self._replay()))["usage"]


async def _next(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _merge(streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """Interleave the choices' streams as messages arrive; (choice index, message)."""
    if len(streams) == 1:  # the common case, without tasks and a queue
        async with aclosing(streams[0]) as only:
            async for msg in only:
                yield 0, msg
        return
    # (n > 1 or several prompts: each choice is pumped by a task into one queue)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator) -> None:
        try:
            async with aclosing(s):
                async for msg in s:
                    queue.put_nowait((i, msg))
            queue.put_nowait((i, None))
        except BaseException as e:
            queue.put_nowait((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
