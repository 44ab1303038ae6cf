"""Router side of the wire: building worker requests, dispatch with retry, reading responses.

    async for msg in dispatch(pool, pick, request):   # pb.GenerateResponse deltas
        ...

A worker is chosen by the policy among the healthy ones. Until the first message arrives, a
failure of that worker (its call fails, or the pool takes it out of rotation) moves the request
to another worker; after tokens have streamed, the failure surfaces as ``WorkerLostError``.
Closing the iterator (the client went away) cancels the gRPC call, which aborts the request on
the worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from pdserve.engine.request import Logprob, TokenLogprobs
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.policy import WorkerLoad
from pdserve.router.pool import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)
Policy = Callable[[Sequence[WorkerLoad]], "str | None"]

# gRPC codes that mean "this worker cannot serve right now" (try another), not "bad request".
_WORKER_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class NoWorkerError(RuntimeError):
    """No healthy worker could take the request."""


class WorkerLostError(RuntimeError):
    """The worker failed after it had streamed tokens."""


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens, include_stop_str_in_output=p.include_stop_str_in_output,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def logprobs_of(msg: pb.GenerateResponse) -> list[TokenLogprobs]:
    def lp(m: pb.TokenLogprob) -> Logprob:
        return Logprob(m.token_id, m.logprob, m.rank)

    return [TokenLogprobs(lp(p.sampled), [lp(t) for t in p.top]) for p in msg.logprobs]


def stop_reason_of(msg: pb.GenerateResponse) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


def invalid_from_details(details: str) -> InvalidRequestError | None:
    """The worker's INVALID_ARGUMENT detail (decode_worker/convert.py encodes it) as an error."""
    try:
        data = json.loads(details)
        err = InvalidRequestError(data["field"], "", data.get("code", "invalid_value"))
        err.args = (data["message"],)
        return err
    except (ValueError, KeyError, TypeError):
        return None


async def dispatch(pool: WorkerPool, policy: Policy, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
    tried: set[str] = set()
    while True:
        candidates = [w for w in pool.healthy() if w.worker_id not in tried]
        chosen = policy([w.load() for w in candidates])
        if chosen is None:
            raise NoWorkerError("no worker is available" if not tried else "every available worker failed")
        worker = pool.by_id(chosen)
        tried.add(chosen)
        worker.inflight += 1
        call = worker.stub.Generate(request)
        started = False
        try:
            first = await _first_message(call, worker)
            if first is None:
                return
            started = True
            yield first
            while (msg := await call.read()) is not grpc.aio.EOF:  # read(): iteration and read() don't mix
                yield msg
            return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid_from_details(e.details() or "") or InvalidRequestError("request", e.details()) from e
            if e.code() not in _WORKER_FAILURES:
                raise
            if started:
                raise WorkerLostError(f"worker {worker.worker_id} failed mid-stream: {e.code().name}") from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                pool.mark_down(worker, f"Generate failed: {e.details()}")
            log.warning("request %s: worker %s failed before streaming (%s); retrying elsewhere",
                        request.request_id, worker.worker_id, e.code().name)
        except _WorkerDown:
            log.warning("request %s: worker %s left the rotation before streaming; retrying elsewhere",
                        request.request_id, worker.worker_id)
        finally:
            worker.inflight -= 1
            call.cancel()  # no-op when the call has finished; aborts the request on the worker otherwise


class _WorkerDown(Exception):
    pass


async def _first_message(call, worker: WorkerHandle) -> pb.GenerateResponse | None:
    """The call's first message (None if it ends without one); the worker leaving the rotation
    before it arrives raises ``_WorkerDown``. Later messages are read from the call directly."""
    first = asyncio.ensure_future(call.read())
    down = asyncio.ensure_future(worker.down.wait())
    try:
        done, _ = await asyncio.wait({first, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
    if first not in done:
        first.cancel()
        raise _WorkerDown()
    msg = first.result()
    return None if msg is grpc.aio.EOF else msg
