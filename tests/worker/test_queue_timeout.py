"""A worker scheduling by priority, with one running slot taken by a long request of a higher class:
a flex request given ``queue_timeout_s`` ends RESOURCE_EXHAUSTED once that time has passed, while
the long request still runs, instead of waiting for as long as higher classes keep the slot. A
real decode worker in this process over the tiny model (the router's side:
tests/router/test_queue_timeout.py)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc

from pdserve.decode_worker.server import DecodeServicer
from pdserve.proto.v1 import worker_pb2 as pb
from tests.worker.serving import SAMPLING, with_worker


def _sampling(priority: int, max_tokens: int) -> pb.SamplingParams:
    s = pb.SamplingParams()
    s.CopyFrom(SAMPLING)
    s.priority, s.max_tokens = priority, max_tokens
    return s


def test_a_flex_request_overtaken_past_its_queue_timeout_ends_resource_exhausted(make_engine):
    engine = make_engine(max_num_seqs=1, scheduling_policy="priority", max_model_len=2048)

    async def body(stub):
        long = stub.Generate(pb.GenerateRequest(request_id="long", prompt_token_ids=list(range(100, 120)),
                                                sampling=_sampling(0, 2000)))
        await long.read()  # it runs, and holds the only slot
        asked = time.monotonic()
        flex = stub.Generate(pb.GenerateRequest(request_id="flex", prompt_token_ids=list(range(200, 220)),
                                                sampling=_sampling(2, 4), queue_timeout_s=0.3))
        try:
            async for _ in flex:
                pass
            raise AssertionError("the flex request ran")
        except grpc.aio.AioRpcError as e:
            error, waited = e, time.monotonic() - asked
        assert not long.done(), "the long request ended first: the test needs it running"
        long.cancel()
        async with asyncio.timeout(30):  # the abort reaches the engine a step later
            while (await stub.Stats(pb.StatsRequest())).num_running:
                await asyncio.sleep(0.01)
        return error, waited

    error, waited = with_worker(engine, DecodeServicer, body)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "flex waited 0.3 s in this worker's queue without starting" in error.details()
    assert waited >= 0.3


def test_a_queue_timeout_that_is_not_a_finite_number_of_seconds_is_refused_naming_it(make_engine):
    async def body(stub):
        codes = []
        for seconds in (-1.0, float("nan"), float("inf")):
            try:
                async for _ in stub.Generate(pb.GenerateRequest(request_id=f"r{seconds}", prompt_token_ids=[1, 2],
                                                                sampling=SAMPLING, queue_timeout_s=seconds)):
                    pass
                codes.append(None)
            except grpc.aio.AioRpcError as e:
                codes.append((e.code(), json.loads(e.details())["field"]))
        return codes

    codes = with_worker(make_engine(scheduling_policy="priority"), DecodeServicer, body)
    assert codes == [(grpc.StatusCode.INVALID_ARGUMENT, "queue_timeout_s")] * 3
