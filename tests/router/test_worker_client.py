"""Reading a worker's stream (router/worker_client.py): a first read left behind when its request is
cancelled (another choice of it failed, or its client left) is dropped quietly: its later failure
is not logged as an exception nobody retrieved."""

from __future__ import annotations

import asyncio
import gc

import grpc

from pdserve.router.worker_client import first_message
from tests.router.conftest import in_rotation


class _LateFailure:
    """A call whose first read fails once ``fail`` is set (the worker refusing the request)."""

    def __init__(self):
        self.fail = asyncio.Event()

    async def read(self):
        await self.fail.wait()
        raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "bad prompt")


def test_a_first_read_left_by_a_cancelled_request_fails_without_an_unretrieved_exception():
    async def main():
        unretrieved = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        call = _LateFailure()
        waiting = asyncio.create_task(first_message(call, in_rotation("decode")))
        await asyncio.sleep(0)  # it waits for the first message
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        call.fail.set()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        return unretrieved

    assert asyncio.run(main()) == []
