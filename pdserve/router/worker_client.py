"""Router side of the wire: building worker requests, reading responses, classifying failures.

Dispatch itself (which worker, retries, migration) is in dispatcher.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.logprobs import Logprob, TokenLogprobs
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.pool import WorkerHandle

# gRPC codes that mean "this worker cannot serve right now" (try another), not "bad request".
WORKER_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class NoWorkerError(RuntimeError):
    """No healthy worker could take the request."""


class WorkerLostError(RuntimeError):
    """The worker failed after it had streamed tokens."""


class QueueTimeoutError(RuntimeError):
    """A worker ended the request unstarted: it waited its queue timeout in the worker's queue while
    requests of a higher service class went ahead of it (RESOURCE_EXHAUSTED; the client's 429)."""


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens, include_stop_str_in_output=p.include_stop_str_in_output,
        priority=p.priority,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprobs_of(positions) -> list[TokenLogprobs]:
    """``msg.logprobs`` or ``msg.prompt_logprobs`` as engine dataclasses."""
    def lp(m: pb.TokenLogprob) -> Logprob:
        return Logprob(m.token_id, m.logprob, m.rank)

    return [TokenLogprobs(lp(p.sampled), [lp(t) for t in p.top]) for p in positions]


def stop_reason_of(msg: pb.GenerateResponse) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


def invalid_from_details(details: str) -> InvalidRequestError | None:
    """The worker's INVALID_ARGUMENT detail (worker/convert.py encodes it) as an error."""
    try:
        data = json.loads(details)
        err = InvalidRequestError(data["field"], "", data.get("code", "invalid_value"))
        err.args = (data["message"],)
        return err
    except (ValueError, KeyError, TypeError):
        return None


class WorkerDown(Exception):
    """The worker left the rotation (or its stream stalled) while a request was on it."""


async def first_message(call, worker: WorkerHandle) -> pb.GenerateResponse | None:
    """The call's first message (None if it ends without one); the worker leaving the rotation
    before it arrives raises ``WorkerDown``. Later messages: ``rest_of_stream``."""
    first = asyncio.ensure_future(call.read())
    down = asyncio.ensure_future(worker.down.wait())
    try:
        done, _ = await asyncio.wait({first, down}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (another choice of the request failed, or its client left)
        _drop(first)
        raise
    finally:
        down.cancel()
    if first not in done:
        _drop(first)
        raise WorkerDown()
    msg = first.result()
    return None if msg is grpc.aio.EOF else msg


def _drop(read: asyncio.Future) -> None:
    """A read nobody will wait for: cancelled, and its failure (if it failed first) marked seen, not
    logged as "Task exception was never retrieved" when it is collected."""
    read.cancel()
    read.add_done_callback(lambda f: f.cancelled() or f.exception())


async def rest_of_stream(call, worker: WorkerHandle, idle_timeout_s: float) -> AsyncIterator[pb.GenerateResponse]:
    """The call's messages after the first. The worker leaving the rotation, or no message for
    ``idle_timeout_s``, raises ``WorkerDown``: the stream is lost, and the request moves on."""
    gone = asyncio.Event()

    async def cancel_when_down() -> None:
        await worker.down.wait()
        gone.set()
        call.cancel()  # the pending read raises CancelledError (not a cancellation of our task)

    watcher = asyncio.create_task(cancel_when_down())
    try:
        while True:
            try:
                async with asyncio.timeout(idle_timeout_s):
                    msg = await call.read()
            except TimeoutError:
                raise WorkerDown(f"no message for {idle_timeout_s:g} s") from None
            except asyncio.CancelledError:
                if gone.is_set() and not asyncio.current_task().cancelling():
                    raise WorkerDown("it left the rotation") from None
                raise
            if msg is grpc.aio.EOF:
                return
            yield msg
    finally:
        watcher.cancel()


async def kv_snapshot(worker: WorkerHandle, timeout_s: float) -> pb.KVSnapshotResponse:
    """The worker's cached prefix hashes as of one of its KV events (the prefix index resyncs from
    it); a gRPC error raises ``grpc.aio.AioRpcError``."""
    return await worker.stub.KVSnapshot(pb.KVSnapshotRequest(), timeout=timeout_s)
