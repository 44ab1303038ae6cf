"""The grpc backend between a real prefill worker server and a real decode worker server (in
this process, on loopback, the tiny model): chunked prompts arrive whole, in float32, bfloat16
and float16; the header's token count is checked; the sender comes from the backend registry."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from pdserve.decode_worker.server import DecodeServicer
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.prefill_worker.server import PrefillServicer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerServer
from tests.conftest import run_to_completion
from tests.kvtransfer.test_local_backend import GREEDY

SAMPLING = pb.SamplingParams(temperature=0, top_p=1, max_tokens=8, ignore_eos=True, repetition_penalty=1)


@pytest.fixture(scope="module")
def models():
    from pdserve.engine.loader import load_model

    return {name: load_model("random:tiny", progress=False, seed=3, dtype=getattr(torch, name))
            for name in ("float32", "bfloat16", "float16")}


def engine(models, dtype: str, **options) -> LLMEngine:
    loaded = models[dtype]
    return LLMEngine(EngineConfig(model=loaded.source.name, load_progress=False, dtype=dtype, num_kv_blocks=128,
                                  **options), loaded=loaded)


def with_pair(models, dtype: str, body, prefill_options=None):
    """Run ``body(decode_stub, prefill_stub)`` against a decode and a prefill worker server."""

    async def main():
        decode = WorkerServer(engine(models, dtype), WorkerConfig(port=0), DecodeServicer)
        prefill = WorkerServer(engine(models, dtype, **(prefill_options or {})), WorkerConfig(port=0),
                               PrefillServicer)
        await decode.start()
        await prefill.start()
        try:
            async with grpc.aio.insecure_channel(decode.address) as cd, \
                    grpc.aio.insecure_channel(prefill.address) as cp:
                return await body(pb_grpc.WorkerStub(cd), pb_grpc.WorkerStub(cp))
        finally:
            await prefill.stop(0)
            await decode.stop(0)

    return asyncio.run(main())


async def disaggregated(decode, prefill, rid: str, prompt: list[int],
                        prefill_prompt: list[int] | None = None) -> tuple[list[int], pb.PrefillResponse]:
    """Reserve, prefill (``prefill_prompt`` if given: a lying sender), resume; (tokens, transfer outcome)."""
    res = await decode.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING))
    tokens, outcome = [], None
    async for msg in prefill.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prefill_prompt or prompt,
                                                       sampling=SAMPLING, destination=res)):
        if msg.HasField("first"):
            tokens += msg.first.token_ids
        if msg.transfer_done:
            outcome = msg
    async for msg in decode.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING,
                                                        kv_handle=res.handle, output_token_ids=tokens)):
        tokens += msg.token_ids
    return tokens, outcome


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_chunked_prompt_arrives_whole(models, dtype):
    prompt = list(range(1000, 1100))  # 100 tokens in chunks of 24: blocks completed over five steps
    reference = engine(models, dtype)
    reference.add_request("r", prompt, GREEDY.replace(max_tokens=8))
    expected = run_to_completion(reference)["r"]

    async def body(decode, prefill):
        return await disaggregated(decode, prefill, "r", prompt)

    tokens, outcome = with_pair(models, dtype, body, {"max_num_batched_tokens": 24})
    assert outcome.transfer_ok, outcome.transfer_error
    assert tokens == expected


def test_a_sender_whose_token_count_differs_from_the_reservation_is_refused(models):
    """40 tokens reserved (3 blocks), 44 prefilled (3 blocks too): the blocks would fit, the KV
    is of another prompt; the decode worker refuses it at the header and computes the prompt."""
    prompt = list(range(2000, 2040))

    async def body(decode, prefill):
        tokens, outcome = await disaggregated(decode, prefill, "r", prompt, prompt + [5, 6, 7, 8])
        return outcome

    outcome = with_pair(models, "float32", body)
    assert not outcome.transfer_ok
    assert "token_count" in outcome.transfer_error
    assert "covers 44 tokens, the reservation 'r' holds 40" in outcome.transfer_error


def test_an_unknown_backend_is_refused_naming_the_registry(models):
    async def body(decode, prefill):
        res = await decode.Reserve(pb.ReserveRequest(request_id="r", prompt_token_ids=list(range(100, 140)),
                                                     sampling=SAMPLING))
        res.backend = "carrier-pigeon"
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in prefill.Prefill(pb.PrefillRequest(request_id="r", prompt_token_ids=list(range(100, 140)),
                                                                 sampling=SAMPLING, destination=res)):
                    pass
        finally:
            await decode.Abort(pb.AbortRequest(request_ids=["r"]))
        return e.value

    error = with_pair(models, "float32", body)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown 'carrier-pigeon'; known: ['grpc', 'local', 'torch']" in error.details()


class _Answering(pb_grpc.WorkerServicer):
    """A receiver that reads a whole stream, then answers ok, or never (``answer`` False)."""

    def __init__(self, answer: bool):
        self.answer = answer
        self.chunks = 0

    async def PushKV(self, request_iterator, context):
        async for _ in request_iterator:
            self.chunks += 1
        if not self.answer:
            await asyncio.Event().wait()
        return pb.PushKVResponse(ok=True)


def push_slowly(answer: bool, timeout_s: float, gap_s: float) -> tuple[tuple[bool, str | None], int]:
    """One chunk, ``gap_s`` of a prefill still computing, another chunk, the commit."""
    from pdserve.kvtransfer.base import KVLayout
    from pdserve.kvtransfer.grpc_backend import GrpcSender

    async def main():
        receiver = _Answering(answer)
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        pb_grpc.add_WorkerServicer_to_server(receiver, server)
        await server.start()
        try:
            sender = GrpcSender(asyncio.get_running_loop(), timeout_s=timeout_s)
            session = sender.open(pb.ReserveResponse(handle="h", kv_address=f"127.0.0.1:{port}"),
                                  KVLayout("m", "float32", 16, 2, 2, 4), 16)
            block = torch.zeros(1, 2 * 16 * 4)
            session.send_layer(0, 0, block, block)
            await asyncio.sleep(gap_s)
            session.send_layer(1, 0, block, block)
            session.commit()
            return await asyncio.wait_for(asyncio.wrap_future(session.done), 60), receiver.chunks
        finally:
            await server.stop(0)

    return asyncio.run(main())


def test_a_stream_may_last_longer_than_the_answer_timeout():
    """The stream lasts as long as the prompt's prefill: no deadline on it, only on the answer."""
    assert push_slowly(answer=True, timeout_s=0.2, gap_s=1.0) == ((True, None), 3)


def test_a_receiver_that_never_answers_the_commit_fails_the_transfer():
    (ok, error), chunks = push_slowly(answer=False, timeout_s=0.5, gap_s=0.0)
    assert chunks == 3
    assert not ok and error == "DEADLINE_EXCEEDED: no answer 0.5 s after the commit"
