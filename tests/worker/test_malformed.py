"""Bytes that are not a method's request message (pdserve/worker/malformed.py): a real worker of each
role in this process, over the tiny model, answers them INVALID_ARGUMENT naming the message type, for
every kind of call (unary, server streaming, client streaming), methods the role does not define
included; well-formed calls answer as before, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest

from pdserve.decode_worker.server import DecodeServicer
from pdserve.prefill_worker.server import PrefillServicer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerServer
from tests.worker.serving import SAMPLING, generated, status_of

JUNK = b"\xff\xff\xff\xff"  # field 31, wire type 7: no protobuf message parses it
PROMPT = list(range(100, 120))


async def _raw(channel: grpc.aio.Channel, method: str, kind: str, payload: bytes) -> grpc.aio.AioRpcError | None:
    """Send raw bytes to ``method``; the error it ends with (None: OK)."""
    call = getattr(channel, kind)(f"/pdserve.v1.Worker/{method}")  # bytes in, bytes out
    try:
        if kind == "unary_stream":
            async for _ in call(payload, timeout=30):
                pass
        elif kind == "stream_unary":
            async def two():
                yield payload
                yield payload

            await call(two(), timeout=30)
        else:
            await call(payload, timeout=30)
    except grpc.aio.AioRpcError as e:
        return e
    return None


async def _serving(engine, role, body):
    """``body(channel)`` against a worker server of that role around ``engine``, in this process;
    ``body(channel, server)`` when it takes the server too."""
    server = WorkerServer(engine, WorkerConfig(port=0), role)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            return await (body(channel, server) if body.__code__.co_argcount == 2 else body(channel))
    finally:
        await server.stop(0)


async def _raw_stream(channel, chunks) -> grpc.aio.AioRpcError | None:
    try:
        await channel.stream_unary("/pdserve.v1.Worker/PushKV")(chunks, timeout=30)
    except grpc.aio.AioRpcError as e:
        return e
    return None


CALLS = {"Health": "unary_unary", "Stats": "unary_unary", "Generate": "unary_stream", "PushKV": "stream_unary",
         "Reserve": "unary_unary", "Prefill": "unary_stream"}


@pytest.mark.parametrize("role", [DecodeServicer, PrefillServicer], ids=["decode", "prefill"])
def test_junk_bytes_get_invalid_argument_naming_the_message_and_the_worker_keeps_serving(make_engine, role, caplog):
    engine = make_engine()

    async def body(channel):
        stub = pb_grpc.WorkerStub(channel)
        errors = {m: await _raw(channel, m, kind, JUNK) for m, kind in CALLS.items()}
        wellformed = {"Health": await status_of(stub.Health(pb.HealthRequest(), timeout=10)),
                      "Reserve": await status_of(stub.Reserve(pb.ReserveRequest(request_id="r"), timeout=10))}
        tokens = await generated(stub, "after", PROMPT) if role is DecodeServicer else None
        return errors, wellformed, tokens

    with caplog.at_level(logging.WARNING, logger="pdserve.worker.malformed"):
        errors, wellformed, tokens = asyncio.run(_serving(engine, role, body))
    if role is PrefillServicer:  # a client stream to a method the role lacks ends before its first message
        assert errors.pop("PushKV").code() == grpc.StatusCode.UNIMPLEMENTED
    for method, error in errors.items():
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
        details = json.loads(error.details())
        assert details["field"] == "request" and details["code"] == "malformed_message", details
        assert f"/pdserve.v1.Worker/{method}" in details["message"] and "pdserve.v1." in details["message"], details
    assert wellformed["Health"] == grpc.StatusCode.OK
    # a role without the method still says so for a well-formed call (the generated base class)
    assert wellformed["Reserve"] == (grpc.StatusCode.UNIMPLEMENTED if role is PrefillServicer
                                     else grpc.StatusCode.INVALID_ARGUMENT)  # decode: an empty prompt
    assert tokens is None or len(tokens) == 4
    refusals = [r for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # once a minute, not once a call


def test_a_malformed_chunk_mid_stream_fails_the_transfer_for_a_new_sender_or_a_recompute(make_engine):
    """A KV push whose second chunk is junk: INVALID_ARGUMENT, and the transfer it began is failed
    (reason ``malformed``), as when a sender dies mid-push: a new sender may take it over, or the
    resume recomputes what is missing."""
    from pdserve.kvtransfer.receiver import TransferState

    async def body(channel, server):
        stub = pb_grpc.WorkerStub(channel)
        reserved = await stub.Reserve(pb.ReserveRequest(request_id="r1", prompt_token_ids=PROMPT, sampling=SAMPLING),
                                      timeout=10)

        async def chunks():
            header = pb.KVChunk(handle=reserved.handle, layout=reserved.layout, total_tokens=len(PROMPT))
            yield header.SerializeToString()  # no blocks: the receiver writes nothing (once a ValueError)
            yield JUNK

        error = await _raw_stream(channel, chunks())
        incoming = server.servicer.receiver.get(reserved.handle)
        await stub.Abort(pb.AbortRequest(request_ids=["r1"]), timeout=10)  # nobody resumes it here
        for _ in range(600):  # the engine thread takes the abort: wait until it holds nothing (60 s at most)
            stats = await stub.Stats(pb.StatsRequest(), timeout=10)
            if stats.num_waiting == 0 and stats.num_running == 0:
                break
            await asyncio.sleep(0.1)
        return error, incoming.state, incoming.reason

    error, state, reason = asyncio.run(_serving(make_engine(), DecodeServicer, body))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert state is TransferState.FAILED and reason == "malformed", (state, reason)
