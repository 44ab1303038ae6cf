"""The workers a router dispatches to: channels, load snapshots, health.

A poller asks every worker for its load snapshot every ``poll_interval_s``. A worker that
fails ``fail_after`` polls in a row, or whose call fails during a request, leaves the
rotation (its ``down`` event is set, so requests waiting on it move elsewhere) and comes back
when it answers again. Workers found through the state store join with ``add`` and leave with
``remove`` while the router runs (router/discovery.py); the ``--worker`` addresses stay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc

from pdserve import cluster_token, compute_id
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.router.policy import WorkerLoad

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(eq=False)
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel | None = None  # opened in the event loop that uses it
    stub: pb_grpc.WorkerStub | None = None
    info: pb.WorkerInfo | None = None
    snapshot: pb.LoadSnapshot | None = None
    healthy: bool = False
    failures: int = 0
    inflight: int = 0  # requests this router has in flight there
    inflight_tokens: int = 0  # their prompt tokens still to compute (until each one's first message)
    down: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info else self.address

    @property
    def role(self) -> str:
        return self.info.role if self.info else "decode"

    def load(self) -> WorkerLoad:
        s = self.snapshot or pb.LoadSnapshot()
        free = s.num_free_kv_blocks * self.info.block_size if self.snapshot and self.info else -1
        return WorkerLoad(self.worker_id, self.inflight, s.num_running, s.num_waiting, s.kv_usage,
                          s.waiting_prompt_tokens, self.inflight_tokens, s.generation_tokens_per_s,
                          s.prefill_tokens_per_s, free, s.decode_step_s, s.decode_step_seqs)


class WorkerPool:
    def __init__(self, addresses: list[str], poll_interval_s: float = 0.5, fail_after: int = 2,
                 timeout_s: float = 2.0):
        self.workers = [WorkerHandle(a) for a in addresses]
        self.poll_interval_s = poll_interval_s
        self.fail_after = fail_after
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set whenever a worker joins or leaves the rotation
        # Called with (worker, in rotation?) as it joins or leaves (the prefix index drops a leaving
        # worker's entries at once and resyncs a joining one); they must not block.
        self.listeners: list[Callable[[WorkerHandle, bool], None]] = []
        self._contention: tuple[tuple, dict[str, frozenset[str]]] = ((), {})

    async def start(self) -> None:
        """Open the channels (in the running event loop), poll once, keep polling."""
        for w in self.workers:
            _open(w)
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="worker-pool-poller")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one round did
                log.exception("worker poll failed")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: WorkerHandle) -> None:
        try:
            if w.info is None:
                w.info = await w.stub.Info(pb.InfoRequest(), timeout=self.timeout_s)
            w.snapshot = await w.stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            w.failures += 1
            if w.healthy and w.failures >= self.fail_after:
                self.mark_down(w, f"{e.code().name}: {e.details()}")
            return
        w.failures = 0
        if not w.healthy and not w.snapshot.draining:
            w.healthy = True
            w.down.clear()
            self.changed.set()
            log.info("worker %s (%s) in rotation", w.worker_id, w.address)
            self._notify(w, True)
        elif w.healthy and w.snapshot.draining:
            self.mark_down(w, "draining")

    async def add(self, address: str) -> WorkerHandle:
        """A worker joins (in rotation once it answers a poll, which is tried now)."""
        w = WorkerHandle(address)
        _open(w)
        self.workers.append(w)
        await self._poll(w)
        return w

    async def remove(self, address: str, linger_s: float = 60.0) -> None:
        """A worker leaves the pool; its channel closes once its requests here end (or after ``linger_s``)."""
        gone = [w for w in self.workers if w.address == address]
        self.workers = [w for w in self.workers if w.address != address]
        for w in gone:
            self.mark_down(w, "left the pool")
            deadline = asyncio.get_running_loop().time() + linger_s
            while w.inflight and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            if w.channel is not None:
                await w.channel.close()

    def mark_down(self, w: WorkerHandle, reason: str) -> None:
        if w.healthy:
            log.warning("worker %s (%s) out of rotation: %s", w.worker_id, w.address, reason)
        w.healthy = False
        w.down.set()
        self.changed.set()
        self._notify(w, False)

    def _notify(self, w: WorkerHandle, in_rotation: bool) -> None:
        for listener in self.listeners:
            try:
                listener(w, in_rotation)
            except Exception:  # a listener's failure must not change the rotation
                log.exception("rotation listener failed")

    async def wait_for(self, role: str, timeout_s: float, exclude: Collection[str] = ()) -> bool:
        """Wait up to ``timeout_s`` for a worker of ``role`` in rotation (one whose id is not in
        ``exclude``); whether there is one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not [w for w in self.healthy(role) if w.worker_id not in exclude]:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self.changed.clear()  # no await between the check and the wait: no change is missed
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def healthy(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers if w.healthy and (role is None or w.role == role)]

    def by_id(self, worker_id: str) -> WorkerHandle:
        return next(w for w in self.workers if w.worker_id == worker_id)

    def model_info(self) -> pb.WorkerInfo | None:
        return model_info(self.workers)

    def contention(self) -> dict[str, frozenset[str]]:
        """Worker id -> the workers it contends with for compute (pdserve/compute_id.py), over every
        worker that has described itself; worked out again when one joins, leaves or changes."""
        key = tuple((w.worker_id, w.info.compute) for w in self.workers if w.info is not None)
        if key != self._contention[0]:
            self._contention = (key, compute_id.contention(dict(key)))
        return self._contention[1]


def model_info(workers: list[WorkerHandle]) -> pb.WorkerInfo | None:
    """The model's description as its workers give it: a decode worker's, else any one's."""
    infos = [w.info for w in workers if w.info is not None]
    return next((i for i in infos if i.role == "decode"), infos[0] if infos else None)


def _open(w: WorkerHandle) -> None:
    w.channel = cluster_token.channel(w.address, options=_CHANNEL_OPTIONS)  # with the cluster token, if any
    w.stub = pb_grpc.WorkerStub(w.channel)
    w.down.set()
