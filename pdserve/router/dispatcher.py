"""Where a request goes, and what happens when a worker fails under it.

    async for msg in dispatcher.run(request):      # pb.GenerateResponse deltas, first token first
        ...

Which workers (``policy.POLICIES``, by name): each request's prompt keys are looked up once in the
global prefix index and this router's recent routes (``cached``: each worker's predicted hit),
and the policy picks among the workers in rotation with them (``cache_aware``: least predicted
seconds, router/cost.py).

Paths (``policy.prefill_route`` decides, before and after the reservation):

    colocated        decode worker: Generate (it prefills its own prompt)
    disaggregated    decode worker: Reserve  ->  prefill_route again, with what is cached there
                     remote: prefill worker: Prefill(destination) -> first token streamed at once
                             decode worker: Generate(kv_handle, output_token_ids=[first],
                                                     emitted_text_len=its text sent so far)
                     local:  decode worker: Generate(kv_handle, prefill_here)

Text: a worker holds back text that may begin a stop string. Whoever continues a request (the
decode worker after the prefill worker, another decode worker after a lost one) gets every
token so far and how much of their text the client has, so stop strings and held-back text
are handled over the whole output, as on one worker.

Faults:
- a worker that fails (or leaves the rotation) before anything was streamed: the request goes
  to another worker of the same pool;
- every prefill worker fails: the decode worker prefills the prompt itself;
- a decode worker lost after tokens were streamed (it failed, left the rotation, or sent
  nothing for ``stream_idle_timeout_s``): the request continues on another decode worker with
  the prompt and the tokens so far (``output_token_ids``, ``emitted_text_len``), so the client's
  stream goes on without a gap or a repeat;
- no decode worker in rotation yet (start-up): a request waits up to ``wait_for_worker_s`` for
  one (or, with a waker, its pool's cold-start bound);
- every decode worker a request tried failed before streaming (one was lost while the others were
  out of rotation for a moment, as a busy machine's missed polls take them): it waits up to
  ``wait_for_worker_s`` for one it has not tried (a replacement, or one back in rotation);
- transfer faults (a dropped, corrupt or stalled transfer) are the decode worker's to handle:
  it computes the prompt itself when the KV does not land within its lease;
- a request that waits unstarted in a worker's queue past its ``queue_timeout_s`` (a worker
  scheduling by priority lets later requests of a higher class go ahead of it) is ended by the
  worker: from a decode worker, the client gets the 429 it would have had from the router's own
  queue (QueueTimeoutError, not retried); from a prefill worker, the decode worker prefills it.
Each fault is counted by reason and logged with the request id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router import cost
from pdserve.router.cost import CostModel, RouteRequest
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import DisaggregationConfig, Policy, PrefillInputs, prefill_route
from pdserve.router.pool import WorkerHandle, WorkerPool
from pdserve.router.prefix_index import PrefixIndex, prompt_keys
from pdserve.router.recent_routes import RecentRoutes, predicted_cached
from pdserve.router.worker_client import (
    WORKER_FAILURES,
    NoWorkerError,
    QueueTimeoutError,
    WorkerDown,
    WorkerLostError,
    first_message,
    invalid_from_details,
    rest_of_stream,
)

log = logging.getLogger(__name__)


@dataclass
class _Route:
    """One request's routing: what the decisions know of it, and the hit predicted where it is prefilled."""

    req: RouteRequest
    keys: list[int]  # the prompt's prefix-index keys (empty: not hashed)
    predicted_cached: int = 0
    picked: dict[str, str] = field(default_factory=dict)  # pool -> the worker last chosen in it
    request_id: str = ""  # for the decisions' debug lines


class Dispatcher:
    def __init__(self, pool: WorkerPool, decode_policy: Policy, prefill_policy: Policy,
                 disaggregation: DisaggregationConfig, metrics: RouterMetrics, max_migrations: int = 3,
                 waker=None, wait_for_worker_s: float = 0.0, stream_idle_timeout_s: float = 60.0,
                 index: PrefixIndex | None = None, cost_model: CostModel = CostModel(),
                 recent_routes_s: float | None = None,
                 on_route: Callable[[str, Sequence[int], str], None] | None = None):
        self.pool = pool
        self.index = index  # the global prefix index (empty where no worker's KV events reach it)
        # Where this router sent recent prompts, ahead of the index's events; per pool, as a remote
        # prefill's blocks end up on both its prefill and its decode worker
        self.recent = None if recent_routes_s is None else {role: RecentRoutes(recent_routes_s)
                                                            for role in ("decode", "prefill")}
        self.on_route = on_route  # (pool, keys, worker id) of each route remembered: shared with other routers
        self.cost_model = cost_model
        self.wait_for_worker_s = wait_for_worker_s  # a request finding no decode worker waits this long for one
        self.stream_idle_timeout_s = stream_idle_timeout_s  # a stream silent this long is lost: migrate
        # Scale from zero (cluster/ray_app.py PoolWaker): asked to start a worker of a pool that has none
        self.waker = waker
        self.decode_policy = decode_policy
        self.prefill_policy = prefill_policy
        self.disaggregation = disaggregation
        self.metrics = metrics
        self.max_migrations = max_migrations
        self._background: set[asyncio.Task] = set()

    async def run(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        generated: list[int] = []
        emitted = 0  # characters of text sent to the client
        finished = False
        route = self._route_request(request)
        stream = self._first_leg(request, route)
        for migration in range(self.max_migrations + 1):
            try:
                async for msg in stream:
                    if not generated and msg.token_ids:  # the first leg's first message: its prefix hit
                        for role, worker_id in route.picked.items():  # stored now; the events follow
                            self._remember(role, route.keys, worker_id)
                        self.metrics.cached_tokens.labels("predicted").inc(route.predicted_cached)
                        self.metrics.cached_tokens.labels("actual").inc(msg.num_cached_tokens)
                    generated.extend(msg.token_ids)
                    emitted += len(msg.text)
                    finished = msg.finished
                    yield msg
                return
            except WorkerLostError as e:
                if finished:  # lost after its last message, before the call's status: nothing is missing
                    log.info("request %s: its worker was lost after the last message (%s)", request.request_id, e)
                    return
                if migration == self.max_migrations:
                    raise
                self.metrics.faults.labels("decode_worker_lost").inc()
                log.warning("request %s: %s; continuing elsewhere after %d tokens", request.request_id, e,
                            len(generated))
                stream = self._colocated(_continuation(request, f"{request.request_id}-m{migration + 1}",
                                                       generated, emitted), route)
                self.metrics.migrations.inc()

    def _route_request(self, request: pb.GenerateRequest) -> _Route:
        """The request as the policies see it: each worker's predicted prefix hit (the index's, or
        this router's recent routes', the larger; the prompt hashed once, and not at all with
        neither), the cheapest remote prefill."""
        prompt = request.prompt_token_ids
        cached: dict[str, int] = {}
        keys: list[int] = []
        info = self.pool.model_info()
        indexed = self.index is not None and self.index.workers
        if (indexed or self.recent is not None) and info is not None and info.block_size > 0:
            started = time.perf_counter()
            keys = prompt_keys(prompt, info.model_fingerprint, info.block_size, request.cache_salt or None)
            hashed = time.perf_counter()
            cached = predicted_cached(keys, self.index if indexed else None, (self.recent or {}).values(),
                                      time.monotonic(), info.block_size)
            self.metrics.decision_seconds.labels("prompt_keys").observe(hashed - started)
            self.metrics.decision_seconds.labels("lookup").observe(time.perf_counter() - hashed)
        prefills = [w.load() for w in self.pool.healthy("prefill")]
        req = cost.with_remote(RouteRequest(len(prompt), cached), prefills, self.cost_model,
                               self.pool.contention() if prefills else None)
        return _Route(req, keys, request_id=request.request_id)

    def _first_leg(self, request: pb.GenerateRequest, route: _Route) -> AsyncIterator[pb.GenerateResponse]:
        prompt = len(request.prompt_token_ids)
        where = prefill_route(PrefillInputs(prompt, bool(self.pool.healthy("prefill")),
                                            prompt_logprobs=request.sampling.HasField("prompt_logprobs")),
                              self.disaggregation)
        if where == "reserve":
            return self._disaggregated(request, route)
        if where == "local_no_prefill_worker" and self.waker is not None and prompt >= \
                self.disaggregation.min_prompt_tokens:
            self.waker.wake("prefill")  # prefilled here meanwhile
        self.metrics.prefill_decisions.labels(where).inc()
        return self._colocated(request, route)

    # ---- colocated -------------------------------------------------------------------------

    async def _colocated(self, request: pb.GenerateRequest, route: _Route) -> AsyncIterator[pb.GenerateResponse]:
        tried: set[str] = set()
        await self._await_decode_worker()
        while True:
            try:
                worker = self._pick("decode", self.decode_policy, tried, route)
            except NoWorkerError:
                if not tried or not await self._another_decode_worker(request, tried):
                    raise
                continue
            started = False
            route.predicted_cached = _predicted(route.req, worker)
            try:
                async for msg in self._generate(worker, request, route.req.prompt_tokens - route.predicted_cached):
                    started = True
                    yield msg
                return
            except _Retry as e:
                if started:
                    raise WorkerLostError(f"worker {worker.worker_id} failed mid-stream: {e}") from e
                self.metrics.retries.inc()
                log.warning("request %s: worker %s failed before streaming (%s); retrying elsewhere",
                            request.request_id, worker.worker_id, e)

    def _decode_wait_s(self) -> float:
        """How long to wait for a decode worker: a pool at zero replicas with a waker is woken and
        waited for through its cold start; otherwise ``wait_for_worker_s``."""
        if not self.pool.healthy("decode") and self.waker is not None and self.waker.can_wake("decode"):
            self.waker.wake("decode")
            self.metrics.cold_starts.labels("decode").inc()
            return self.waker.timeouts["decode"]
        return self.wait_for_worker_s

    async def _await_decode_worker(self) -> None:
        """With no decode worker in rotation: wake the pool if it is at zero replicas and wait for
        its cold start, or wait ``wait_for_worker_s`` for one still starting."""
        if self.pool.healthy("decode"):
            return
        timeout_s = self._decode_wait_s()
        if timeout_s > 0:
            await self.pool.wait_for("decode", timeout_s)

    async def _another_decode_worker(self, request: pb.GenerateRequest, tried: set[str]) -> bool:
        """Every decode worker this request tried failed and none other is in rotation: wait up to
        ``wait_for_worker_s`` for one it has not tried (with a waker and the pool now at zero, wake
        it and wait its cold start); whether one came."""
        timeout_s = self._decode_wait_s()
        if timeout_s <= 0:
            return False
        log.warning("request %s: every decode worker in rotation failed (%s); waiting up to %.0f s for another",
                    request.request_id, ", ".join(sorted(tried)), timeout_s)
        return await self.pool.wait_for("decode", timeout_s, exclude=tried)

    async def _generate(self, worker: WorkerHandle, request: pb.GenerateRequest,
                        prefill_tokens: int) -> AsyncIterator[pb.GenerateResponse]:
        """A worker's Generate stream; its failures become ``_Retry`` (bad input stays an error).
        ``prefill_tokens``: the prompt tokens it is predicted to compute before its first message."""
        worker.inflight += 1
        worker.inflight_tokens += prefill_tokens
        call = worker.stub.Generate(request)
        try:
            try:
                first = await first_message(call, worker)
            finally:
                worker.inflight_tokens -= prefill_tokens
            if first is None:
                return
            yield first
            async for msg in rest_of_stream(call, worker, self.stream_idle_timeout_s):
                yield msg
        except grpc.aio.AioRpcError as e:
            raise self._classify(worker, e, "Generate") from e
        except WorkerDown as e:
            raise _Retry(str(e) or "it left the rotation") from e
        finally:
            worker.inflight -= 1
            call.cancel()  # no-op once finished; otherwise aborts the request on the worker

    def _classify(self, worker: WorkerHandle, e: grpc.aio.AioRpcError, rpc: str) -> Exception:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return invalid_from_details(e.details() or "") or InvalidRequestError("request", e.details() or "")
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # it did not start within its queue timeout
            self.metrics.faults.labels("queue_timeout").inc()
            return QueueTimeoutError(f"worker {worker.worker_id}: {e.details()}")
        if e.code() not in WORKER_FAILURES:
            return e
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            self.pool.mark_down(worker, f"{rpc} failed: {e.details()}")
        return _Retry(f"{rpc}: {e.code().name}")

    def _pick(self, role: str, policy: Policy, tried: set[str], route: _Route,
              like: WorkerHandle | None = None) -> WorkerHandle:
        started = time.perf_counter()
        candidates = [w for w in self.pool.healthy(role) if w.worker_id not in tried and compatible(w, like)]
        loads = [w.load() for w in candidates]
        chosen = policy(loads, route.req)
        self.metrics.decision_seconds.labels(role).observe(time.perf_counter() - started)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", route.request_id, cost.describe_pick(role, loads, route.req, chosen,
                                                                            self.cost_model))
        if chosen is None:
            raise NoWorkerError(f"no {role} worker is available" if not tried else f"every {role} worker failed")
        tried.add(chosen)
        route.picked[role] = chosen
        self._remember(role, route.keys, chosen)  # its blocks will be there
        return self.pool.by_id(chosen)

    def _remember(self, role: str, keys: list[int], worker_id: str) -> None:
        """The prompt's blocks are (or will be) on ``worker_id``: count them held there for
        recent_routes_s from now, here and, through ``on_route``, at the other routers."""
        if self.recent is None or not keys:
            return
        self.recent[role].add(keys, worker_id, time.monotonic())
        if self.on_route is not None:
            self.on_route(role, keys, worker_id)

    # ---- disaggregated ----------------------------------------------------------------------

    async def _disaggregated(self, request: pb.GenerateRequest, route: _Route) -> AsyncIterator[pb.GenerateResponse]:
        decode, reservation = await self._reserve(request, route)
        if reservation is None:  # no decode worker has room to reserve: queue colocated instead
            self.metrics.prefill_decisions.labels("local_no_room").inc()
            async for msg in self._colocated(request, route):
                yield msg
            return
        inputs = self._prefill_inputs(request, route.req, decode, reservation)
        where = prefill_route(inputs, self.disaggregation)
        self.metrics.prefill_decisions.labels(where).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", request.request_id, cost.describe_prefill(
                where, decode.worker_id, inputs.local_s, inputs.remote_s, inputs.cached_tokens))
        resume = pb.GenerateRequest()
        resume.CopyFrom(request)
        resume.kv_handle = reservation.handle
        first = await self._prefill(request, reservation, decode, route) if where == "remote" else None
        uncached = 0
        if first is None:
            route.picked.pop("prefill", None)  # every prefill worker failed: the blocks are the decode worker's
            resume.prefill_here = True
            route.predicted_cached = reservation.cached_tokens
            uncached = len(request.prompt_token_ids) - reservation.cached_tokens
        else:
            if first.finished:  # the first token was the last (a stop, max_tokens 1): nothing to decode
                await self._release(decode, reservation.handle)
                yield first
                return
            yield first
            resume.output_token_ids.extend(first.token_ids)
            resume.emitted_text_len = len(first.text)
        try:
            async for msg in self._generate(decode, resume, uncached):
                yield msg
        except _Retry as e:
            raise WorkerLostError(f"decode worker {decode.worker_id} failed: {e}") from e

    def _prefill_inputs(self, request: pb.GenerateRequest, req: RouteRequest, decode: WorkerHandle,
                        reservation: pb.ReserveResponse) -> PrefillInputs:
        """The second decision's inputs: the decode worker's real hit, and both ways in predicted seconds."""
        m, prompt = self.cost_model, len(request.prompt_token_ids)
        uncached = prompt - reservation.cached_tokens
        load = decode.load()
        local_s = cost.local_prefill_s(load, uncached, m)
        remote_s = None if req.remote_s is None else (cost.via_remote_s(req.remote_s, uncached, m)
                                                       + cost.remote_interference_s(load, req, m))
        return PrefillInputs(prompt, True, True, reservation.cached_tokens, local_s=local_s, remote_s=remote_s)

    async def _reserve(self, request: pb.GenerateRequest,
                       route: _Route) -> tuple[WorkerHandle | None, pb.ReserveResponse | None]:
        tried: set[str] = set()
        await self._await_decode_worker()
        while True:
            try:
                worker = self._pick("decode", self.decode_policy, tried, route)
            except NoWorkerError:
                if not tried:
                    raise
                return None, None
            try:
                return worker, await worker.stub.Reserve(pb.ReserveRequest(
                    request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                    sampling=request.sampling, cache_salt=request.cache_salt), timeout=10)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    continue
                err = self._classify(worker, e, "Reserve")
                if not isinstance(err, _Retry):
                    raise err from e

    async def _prefill(self, request: pb.GenerateRequest, reservation: pb.ReserveResponse,
                       decode: WorkerHandle, route: _Route) -> pb.GenerateResponse | None:
        """The first token from a prefill worker (trying each in turn), or None if all fail."""
        tried: set[str] = set()
        while True:
            try:
                worker = self._pick("prefill", self.prefill_policy, tried, route, like=decode)
            except NoWorkerError:
                self.metrics.faults.labels("no_prefill_worker").inc()
                log.warning("request %s: no prefill worker could take it; the decode worker prefills",
                            request.request_id)
                return None
            route.predicted_cached = _predicted(route.req, worker)
            worker.inflight += 1
            worker.inflight_tokens += len(request.prompt_token_ids)
            call = worker.stub.Prefill(pb.PrefillRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling, cache_salt=request.cache_salt, destination=reservation,
                queue_timeout_s=request.queue_timeout_s))
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    if msg.HasField("first"):
                        # The transfer's outcome is the decode worker's to judge; the rest of this
                        # stream (the sender's view of it) is read in the background.
                        task = asyncio.create_task(self._drain_prefill(call, request.request_id))
                        self._background.add(task)
                        task.add_done_callback(self._background.discard)
                        return msg.first
                raise _Retry("the stream ended without a first token")
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # refused at the handshake
                    self.metrics.faults.labels("prefill_refused").inc()
                    log.error("request %s: prefill worker %s refused the transfer: %s", request.request_id,
                              worker.worker_id, e.details())
                    continue
                err = self._classify(worker, e, "Prefill")
                if isinstance(err, QueueTimeoutError):  # its queue is long: the decode worker prefills
                    log.warning("request %s: %s; the decode worker prefills", request.request_id, err)
                    return None
                if not isinstance(err, _Retry):
                    raise err from e
                self.metrics.faults.labels("prefill_worker_failed").inc()
                log.warning("request %s: prefill worker %s failed (%s); trying another", request.request_id,
                            worker.worker_id, err)
            finally:
                worker.inflight -= 1
                worker.inflight_tokens -= len(request.prompt_token_ids)

    async def _drain_prefill(self, call, request_id: str) -> None:
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.transfer_done and not msg.transfer_ok:
                    log.warning("request %s: the prefill worker reports its KV transfer failed: %s", request_id,
                                msg.transfer_error)
        except grpc.aio.AioRpcError:
            pass  # the decode worker handles a transfer that never completes

    async def _release(self, worker: WorkerHandle, handle: str) -> None:
        try:
            await worker.stub.Abort(pb.AbortRequest(request_ids=[handle]), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # the lease frees it anyway


def _continuation(request: pb.GenerateRequest, request_id: str, generated: list[int],
                  emitted: int) -> pb.GenerateRequest:
    """The request for the worker that continues it: every token so far, and how much of their
    text the client has (the rest was held back by the lost worker)."""
    follow = pb.GenerateRequest()
    follow.CopyFrom(request)
    follow.request_id = request_id
    follow.ClearField("kv_handle")
    follow.prefill_here = False
    follow.queue_timeout_s = 0  # it started: the client has its text so far
    follow.sampling.ClearField("prompt_logprobs")  # sent with the first token already
    del follow.output_token_ids[:]
    follow.output_token_ids.extend(generated)
    follow.emitted_text_len = emitted
    return follow


def _predicted(req: RouteRequest, worker: WorkerHandle) -> int:
    """The prefix hit predicted on ``worker`` (an engine computes at least the prompt's last token)."""
    return max(min(req.cached.get(worker.worker_id, 0), req.prompt_tokens - 1), 0)


def compatible(worker: WorkerHandle, like: WorkerHandle | None) -> bool:
    """Whether ``worker`` can exchange KV with ``like``: same model and block size (as both
    report them). The transfer's handshake checks the full layout again."""
    if like is None or worker.info is None or like.info is None:
        return True
    return (worker.info.model_fingerprint, worker.info.block_size) == (like.info.model_fingerprint,
                                                                       like.info.block_size)


class _Retry(Exception):
    """A worker failed in a way another worker may not."""
