"""The transfer protocol: layout header, checksums, states, the two sides' interfaces, backends.

Call protocol (one transfer = one request's prompt KV, prefill worker -> decode worker):

    decode worker                                   prefill worker
    receiver.expect(handle, block_ids,              (the router passes the Reserve answer on)
                    skip_blocks, num_tokens, lease_s)
                                                    session = sender.open(destination, layout,
                                                                          total_tokens)
    handshake: layouts compared, and the        <-  (first chunk carries the header)
      sender's total_tokens with the reserved
      prompt's; a mismatch fails the transfer
      naming both values
    on_chunk(layer, first_block, k, v, crc)     <-  session.send_layer(layer, first_block, k, v)
                                                     ... during every prefill step, for each
                                                     layer as it finishes: the blocks that
                                                     step completed (several chunks per layer
                                                     for a prompt prefilled in several steps)
    commit: every layer of every block seen,    <-  session.commit()        (exactly once)
      none twice -> TransferState.DONE               session.abort(reason)   (instead, on failure)
    a bad checksum, a broken stream, or the lease running out -> TransferState.FAILED: the
    decode worker computes the prompt itself; the request's output is the same.

Sessions are used from one thread at a time (the prefill worker's export thread); ``done`` (a
``concurrent.futures.Future``) resolves with (ok, error) on either side's terms.

Wire versions: 1, a layer's blocks sent during the step that completed the prompt; 2, during
the step that completes each block (a block partly filled by one chunk goes once the next
completes it), each block of each layer exactly once, the header's token count checked.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kvtransfer.faults import KVFaults

WIRE_VERSION = 2


class TransferState(enum.Enum):
    WAITING = "waiting"  # blocks reserved, nothing received yet
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class TransferError(RuntimeError):
    """A transfer that cannot go on; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """What a transfer's bytes mean. Both sides must agree on every field."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    version: int = WIRE_VERSION
    # Per layer, the window whose blocks the cache keeps (0: every block); () when every layer
    # keeps every block. A layer with a window is sent only the blocks the next position's
    # window sees (``first_block``); the rest its receiver holds no block for.
    layer_windows: tuple[int, ...] = ()

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming every field that differs, with both sides' values; None if equal."""
        diffs = [f"{f}: sender {getattr(other, f)!r}, receiver {getattr(self, f)!r}"
                 for f in ("version", "model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads",
                           "head_dim", "layer_windows") if getattr(self, f) != getattr(other, f)]
        return "KV layout mismatch (" + "; ".join(diffs) + ")" if diffs else None

    @property
    def block_elements(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim

    def first_block(self, layer: int, num_tokens: int) -> int:
        """The first block of ``layer`` a transfer of a ``num_tokens`` prompt carries: 0, or for a
        windowed layer the one holding the first position the next token's window sees."""
        window = self.layer_windows[layer] if self.layer_windows else 0
        return max(0, num_tokens - window + 1) // self.block_size if window else 0

    def to_proto(self, pb):
        return pb.KVLayout(version=self.version, model_fingerprint=self.model_fingerprint, dtype=self.dtype,
                           block_size=self.block_size, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, layer_windows=self.layer_windows)

    @classmethod
    def from_proto(cls, m) -> KVLayout:
        return cls(m.model_fingerprint, m.dtype, m.block_size, m.num_layers, m.num_kv_heads, m.head_dim, m.version,
                   tuple(m.layer_windows))


def checksum(*parts: bytes | memoryview) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes: without a copy for a contiguous CPU tensor (a GPU one is copied to the CPU)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class SendSession(Protocol):
    done: Future

    def send_layer(self, layer: int, first_block: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def commit(self) -> None: ...

    def abort(self, reason: str) -> None: ...


@dataclass(frozen=True)
class SenderContext:
    """What a prefill worker builds its senders from: ``sender_class(name).create(context)``."""

    loop: asyncio.AbstractEventLoop  # the worker's event loop (the gRPC streams run on it)
    worker_id: str  # names this sender to its receivers (the torch backend's process groups)
    faults: KVFaults = KVFaults()  # tests only: faults injected into the sending path
    local_hub: object = None  # the local backend's in-process receivers (a LocalHub), if any


class KVSender(Protocol):
    @classmethod
    def create(cls, context: SenderContext) -> KVSender: ...

    def open(self, destination, layout: KVLayout, total_tokens: int) -> SendSession: ...


# Backends by name, imported when chosen (the torch backend pulls in torch.distributed).
BACKENDS: dict[str, str] = {
    "grpc": "pdserve.kvtransfer.grpc_backend:GrpcSender",
    "local": "pdserve.kvtransfer.local:LocalSender",
    "torch": "pdserve.kvtransfer.torch_backend:TorchSender",
}


def register_backend(name: str, target: str) -> None:
    BACKENDS[name] = target


def sender_class(name: str) -> type[KVSender]:
    """The sender of backend ``name``, its module imported now; ValueError naming the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"kv transfer backend: unknown {name!r}; known: {sorted(BACKENDS)}")
    module, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
