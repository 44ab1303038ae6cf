"""The torch backend: KV tensors by torch.distributed point-to-point (gloo on CPU, nccl on GPU
through the same code), control messages over the grpc backend's stream.

Each (prefill worker, decode worker) pair gets a process group of two, made on first use
through a TCPStore the decode worker hosts (its address travels in the reservation), its keys
named under a digest of the cluster token (``cluster_token.rendezvous_namespace``): rank 0
sends, rank 1 receives. Per chunk, the sender posts ``send(tensor, tag)`` and streams the
chunk's metadata (layer, blocks, checksum, tag) over gRPC; the receiver posts the matching
``recv`` when the metadata arrives. The tensor is the layer's blocks, keys then values.
"""

from __future__ import annotations

import datetime
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from pdserve import cluster_token
from pdserve.kvtransfer.base import KVLayout, SenderContext, TransferError, checksum, tensor_bytes
from pdserve.kvtransfer.grpc_backend import GrpcSender, GrpcSession
from pdserve.proto.v1 import worker_pb2 as pb

_GROUP_PREFIX = "pdserve-kv"


def host_store(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """The decode worker's rendezvous for its senders' process groups."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class PairGroups:
    """Process groups of two, one per (store, group name), made on first use: blocking until the
    other side joins, and never twice at once for the same name (concurrent receives of a new
    peer's first chunks wait for the one rendezvous). A group that failed is never made again
    under its name: the sender moves on to the next generation of the name (``peer/N``)."""

    def __init__(self, timeout_s: float = 30.0, namespace: str | None = None):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # TCPStore has no authentication but lists no keys: a group's keys are named under a digest
        # of the cluster token, so a caller on the network without it cannot join a pair's group
        # (nor post tensors to it); the transfer's control messages go over the token-checked gRPC.
        self.namespace = namespace if namespace is not None else cluster_token.rendezvous_namespace()
        self._groups: dict[tuple[str, str], object] = {}
        self._making: dict[tuple[str, str], threading.Lock] = {}
        self._dead: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def get(self, store_address: str, name: str, rank: int, device: torch.device):
        key = (store_address, name)
        with self._lock:
            making = self._making.setdefault(key, threading.Lock())
        with making:
            with self._lock:
                if key in self._dead:
                    raise TransferError("peer_group", f"process group {name!r} failed earlier")
                group = self._groups.get(key)
            if group is not None:
                return group
            host, port = store_address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
            prefixed = dist.PrefixStore(f"{_GROUP_PREFIX}/{self.namespace}/{name}", store)
            if device.type == "cuda":
                group = dist.ProcessGroupNCCL(prefixed, rank, 2)
            else:
                group = dist.ProcessGroupGloo(prefixed, rank, 2, self.timeout)
            with self._lock:
                self._groups[key] = group
            return group

    def fail(self, store_address: str, name: str) -> None:
        with self._lock:
            self._groups.pop((store_address, name), None)
            self._dead.add((store_address, name))


class TorchSender:
    def __init__(self, grpc_sender: GrpcSender, peer: str, groups: PairGroups | None = None):
        self.grpc = grpc_sender
        self.peer = peer
        self.groups = groups or PairGroups()
        self._tags = itertools.count()
        self._executors: dict[str, ThreadPoolExecutor] = {}  # one sending thread per destination, in order
        self._generation: dict[str, int] = {}  # per destination store: bumped when a group fails
        self._lock = threading.Lock()

    @classmethod
    def create(cls, context: SenderContext) -> TorchSender:
        return cls(GrpcSender.create(context), context.worker_id)

    def group_name(self, store: str) -> str:
        with self._lock:
            return f"{self.peer}/{self._generation.get(store, 0)}"

    def group_failed(self, store: str, name: str) -> None:
        """Make the next transfer to ``store`` rendezvous afresh under a new name."""
        self.groups.fail(store, name)
        with self._lock:
            if name == f"{self.peer}/{self._generation.get(store, 0)}":
                self._generation[store] = self._generation.get(store, 0) + 1

    def executor(self, store: str) -> ThreadPoolExecutor:
        with self._lock:
            if store not in self._executors:
                self._executors[store] = ThreadPoolExecutor(1, thread_name_prefix="kv-torch-send")
            return self._executors[store]

    def next_tag(self) -> int:
        return next(self._tags)

    def open(self, destination: pb.ReserveResponse, layout: KVLayout, total_tokens: int) -> TorchSession:
        return TorchSession(self, destination, layout, total_tokens)


class TorchSession(GrpcSession):
    def __init__(self, sender: TorchSender, destination: pb.ReserveResponse, layout: KVLayout, total_tokens: int):
        super().__init__(sender.grpc, destination, layout, total_tokens)
        self.torch_sender = sender
        self.store = destination.backend_info["store"]
        self._executor = sender.executor(self.store)
        self.group = sender.group_name(self.store)
        self._pending: list = []
        self.done.add_done_callback(self._on_done)

    def _on_done(self, done) -> None:
        self._pending.clear()
        ok, error = done.result()
        if not ok and error and error.startswith("peer_group:"):  # the receiver lost the group
            self.torch_sender.group_failed(self.store, self.group)

    def send_layer(self, layer: int, first_block: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        faults = self.sender.faults
        if faults.drop_layer == layer:
            return
        buf = torch.cat([keys.reshape(-1), values.reshape(-1)])
        crc = checksum(tensor_bytes(buf))
        if faults.corrupt_layer == layer:
            buf.view(torch.uint8)[0] ^= 0xFF
        tag = self.torch_sender.next_tag()
        self._executor.submit(self._send, buf, tag)
        self.sent_bytes += buf.numel() * buf.element_size()
        self._put(pb.KVChunk(handle=self.handle, layer=layer, first_block=first_block, num_blocks=keys.shape[0],
                             checksum=crc, peer=self.group, tag=tag))

    def _send(self, buf: torch.Tensor, tag: int) -> None:
        """Post the send (not waiting: every tensor of every transfer is posted at once, so no
        send waits behind another whose receive is not posted yet); keep ``buf`` alive until the
        transfer is over."""
        sender = self.torch_sender
        try:
            group = sender.groups.get(self.store, self.group, 0, buf.device)
            work = group.send([buf], 1, tag)
        except Exception as e:  # the receiver went away: the next transfer makes a new group
            sender.group_failed(self.store, self.group)
            self.abort(f"torch.distributed send failed: {e}")
            return
        if not self.done.done():
            self._pending.append((work, buf))


class TorchReceiving:
    """The decode worker's side: receive a chunk's tensor when its metadata arrives."""

    def __init__(self, store_address: str, layout: KVLayout, dtype: torch.dtype, device: torch.device,
                 groups: PairGroups | None = None, per_block: int | None = None):
        self.store_address = store_address
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.groups = groups or PairGroups()
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="kv-torch-recv")
        # Elements of one block of one layer's keys (or values) in the cache.
        self.per_block = per_block or layout.num_kv_heads * layout.block_size * layout.head_dim

    def receive(self, chunk: pb.KVChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocking (run it in ``pool``): the chunk's keys and values, checksum verified."""
        per_block = self.per_block
        buf = torch.empty(2 * chunk.num_blocks * per_block, dtype=self.dtype, device=self.device)
        try:
            group = self.groups.get(self.store_address, chunk.peer, 1, self.device)
            group.recv([buf], 0, chunk.tag).wait()
        except TransferError:
            raise
        except Exception as e:  # the group is unusable: the sender starts a new one on this reason
            self.groups.fail(self.store_address, chunk.peer)
            raise TransferError("peer_group", f"torch.distributed recv from {chunk.peer!r} failed: {e}") from e
        if checksum(tensor_bytes(buf if buf.device.type == "cpu" else buf.cpu())) != chunk.checksum:
            raise TransferError("checksum", f"layer {chunk.layer}, blocks from {chunk.first_block}: checksum mismatch")
        keys, values = buf.view(2, chunk.num_blocks, per_block).unbind(0)
        return keys, values
