"""The cluster token on a worker's gRPC (pdserve/cluster_token.py): a worker holding one answers every
kind of call without it, or with another, UNAUTHENTICATED before the servicer sees it; a channel made
by ``cluster_token.channel`` in a process holding the token gets through. A real decode worker in this
process over the tiny model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve import cluster_token
from pdserve.decode_worker.server import DecodeServicer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerServer
from tests.worker.serving import SAMPLING, generated, status_of

PROMPT = list(range(100, 140))


async def _statuses(stub) -> dict[str, grpc.StatusCode]:
    """One call of each kind: unary (Health, Drain's neighbour Stats), server streaming (Generate),
    client streaming (PushKV)."""
    async def chunks():
        yield pb.KVChunk(handle="nothing")

    generate = stub.Generate(pb.GenerateRequest(request_id="g", prompt_token_ids=PROMPT, sampling=SAMPLING))
    return {"Health": await status_of(stub.Health(pb.HealthRequest(), timeout=10)),
            "Stats": await status_of(stub.Stats(pb.StatsRequest(), timeout=10)),
            "Generate": await _drained(generate),
            "PushKV": await status_of(stub.PushKV(chunks(), timeout=10)),
            "Abort": await status_of(stub.Abort(pb.AbortRequest(request_ids=["g"]), timeout=10))}


async def _drained(call) -> grpc.StatusCode:
    """The status a server-streaming call ends with, read to its end."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _with_token_worker(engine, body):
    async def main():
        server = WorkerServer(engine, WorkerConfig(port=0), DecodeServicer)
        await server.start()
        try:
            return await body(server.address)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def test_a_worker_with_a_token_refuses_callers_without_it(make_engine, monkeypatch):
    monkeypatch.setenv(cluster_token.TOKEN_ENV, "the-right-token")

    async def body(address):
        async with grpc.aio.insecure_channel(address) as plain:
            without = await _statuses(pb_grpc.WorkerStub(plain))
        wrong = [("authorization", "Bearer another-token")]
        async with grpc.aio.insecure_channel(address) as plain:
            stub = pb_grpc.WorkerStub(plain)
            wrong_status = await status_of(stub.Health(pb.HealthRequest(), metadata=wrong, timeout=10))
            try:
                await stub.Stats(pb.StatsRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:
                message = e.details()
        async with cluster_token.channel(address) as holding:
            stub = pb_grpc.WorkerStub(holding)
            tokens = await generated(stub, "ok", PROMPT)
            health = await stub.Health(pb.HealthRequest(), timeout=10)
            holding_statuses = await _statuses(stub)
        return without, wrong_status, message, tokens, health, holding_statuses

    without, wrong_status, message, tokens, health, holding = _with_token_worker(make_engine(), body)
    assert set(without.values()) == {grpc.StatusCode.UNAUTHENTICATED}, without
    assert grpc.StatusCode.UNAUTHENTICATED not in holding.values(), holding  # every kind of call gets through
    assert wrong_status == grpc.StatusCode.UNAUTHENTICATED
    assert cluster_token.TOKEN_ENV in message and "the-right-token" not in message
    assert len(tokens) == 4 and health.ok


def test_without_a_token_the_worker_is_open_and_says_so_beyond_loopback(make_engine, monkeypatch, caplog):
    monkeypatch.delenv(cluster_token.TOKEN_ENV, raising=False)

    async def body(address):
        async with grpc.aio.insecure_channel(address) as plain:
            return await generated(pb_grpc.WorkerStub(plain), "open", PROMPT)

    assert len(_with_token_worker(make_engine(), body)) == 4
    assert cluster_token.server_interceptors("127.0.0.1") == []
    with caplog.at_level("WARNING", logger="pdserve.cluster_token"):
        assert cluster_token.server_interceptors("0.0.0.0") == []
    assert "takes calls from anyone" in caplog.text


def test_ensure_token_makes_one_and_keeps_it(monkeypatch):
    monkeypatch.delenv(cluster_token.TOKEN_ENV, raising=False)
    assert cluster_token.token() is None
    made = cluster_token.ensure_token()
    assert len(made) >= 32 and cluster_token.token() == made == cluster_token.ensure_token()


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """ensure_token writes os.environ itself: monkeypatch puts it back after each test."""
    monkeypatch.setenv(cluster_token.TOKEN_ENV, "placeholder")
    monkeypatch.delenv(cluster_token.TOKEN_ENV)
