"""A Router in this process, driven over ASGI (no worker processes; workers are set by the test)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.app import Router, RouterConfig
from pdserve.router.models import ServedModel
from pdserve.router.pool import WorkerHandle, WorkerPool

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(MODEL)


def run(coro):
    return asyncio.run(coro)


def in_rotation(role: str, max_model_len: int = 8192) -> WorkerHandle:
    """A worker handle as the pool holds one that answered its polls (no process behind it)."""
    info = pb.WorkerInfo(worker_id=f"{role}-0", role=role, model=MODEL, max_model_len=max_model_len)
    return WorkerHandle(f"127.0.0.1:1{len(role)}", info=info, healthy=True)


@pytest.fixture
def make_client(tokenizer):
    """``make_client(workers, auth=None, **config)``: an httpx client on a Router over those worker handles."""
    clients = []

    def make(workers: list[WorkerHandle] = (), waker=None, auth=None, **config) -> httpx.AsyncClient:
        pool = WorkerPool([])
        pool.workers = list(workers)
        router = Router(RouterConfig(**config), pool, [ServedModel(MODEL, tokenizer)], wakers={"": waker}, auth=auth)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=router.create_app()), base_url="http://router")
        client.router = router  # for tests that act on its pool
        clients.append(client)
        return client

    yield make


class ScriptedCall:
    """A worker call as the router reads it (``read``, ``cancel``): fixed messages, then EOF; or, with
    ``error``, a failure of that status once they are read (at the first read without messages)."""

    def __init__(self, messages=(), error: grpc.StatusCode | None = None):
        self.messages, self.error = list(messages), error

    async def read(self):
        if self.messages:
            return self.messages.pop(0)
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "killed")
        return grpc.aio.EOF

    def cancel(self):
        return False

