"""A worker server of a given role in this process, for tests of a role's gRPC surface."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerServer

SAMPLING = pb.SamplingParams(temperature=0, top_p=1, max_tokens=4, ignore_eos=True, repetition_penalty=1)


def with_worker(engine, servicer_cls, body):
    """Run ``body(stub)`` against a worker server of that role around ``engine`` (an LLMEngine)."""

    async def main():
        server = WorkerServer(engine, WorkerConfig(port=0), servicer_cls)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                return await body(pb_grpc.WorkerStub(channel))
        finally:
            await server.stop(0)

    return asyncio.run(main())


async def status_of(call) -> grpc.StatusCode:
    """The status a unary (or client-streaming) call ends with."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def generated(stub, request_id: str, prompt: list[int]) -> list[int]:
    """The tokens of a colocated Generate."""
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=SAMPLING)
    return [t async for msg in stub.Generate(request) for t in msg.token_ids]
