"""Shipping a prompt's KV out of the engine, step by step and layer by layer, while it computes.

A prompt longer than the step's token budget is prefilled in several steps (chunked prefill).
During every step, after each layer, the exporter snapshots that layer's blocks the step
*completed* and hands the copy to its sender thread, which serialises, checksums and queues it
on the request's transfer session; after the last layer of the step that completes the prompt
it commits. So the transfer overlaps the compute of every chunk, not only the last one::

    prompt of 1100 tokens, budget 512, blocks of 16 (block i holds tokens [16 i, 16 i + 16))
    step 1 computes tokens [0, 512)     -> blocks [0, 32) complete: sent during step 1
    step 2 computes tokens [512, 1024)  -> blocks [32, 64): sent during step 2
    step 3 computes tokens [1024, 1100) -> blocks [64, 69) (the last one partly filled, but
                                           final): sent during step 3, then commit

A block a step fills only partly (a chunk that ends mid-block) waits for the step that
completes it, so every block goes exactly once, with its final content. Blocks the destination
already caches (``skip_blocks``) never go; blocks this worker had cached (its own prefix hit)
go with the first step's.

With layer groups (a sliding-window model, kv_cache_manager.KVGroups), each layer's blocks come
from its group's table and slot of the cache, and a windowed layer sends only the blocks the
window of the position after the prompt sees (``KVLayout.first_block``): the rest the
destination holds no block for.

Why a copy on the engine thread: once the step that completes the prompt ends, the request
finishes (it asked for one token) and its blocks return to the pool; a preempted or aborted
request's blocks do too; a block shared through the prefix cache may be evicted as soon as no
request holds it. Any of them may be overwritten by the next step. An ``index_select`` into a
fresh tensor on the cache's device, taken right after the layer wrote it, is the data as
computed whatever happens to the blocks later. It is a memcpy of the step's new blocks of one
layer (512 tokens of SmolLM2 in float32: 0.8 MB), small next to the layer's compute; the
serialisation copy and the checksum happen on the sender thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledRequest
from pdserve.kvtransfer.base import SendSession

log = logging.getLogger(__name__)


@dataclass
class Export:
    session: SendSession
    skip_blocks: int  # blocks the destination already has
    num_prompt_tokens: int
    next_block: int = -1  # the first block not handed to the sender yet (-1: skip_blocks)
    closed: bool = False  # committed or aborted: nothing more goes to the session (sender thread only)

    def advance(self, item: ScheduledRequest, block_size: int) -> tuple[int, int, bool] | None:
        """The blocks ``[first, end)`` this step completes and whether it completes the prompt;
        None when it completes neither a block nor the prompt. Engine thread."""
        first = self.skip_blocks if self.next_block < 0 else self.next_block
        computed = min(item.start + item.num_tokens, self.num_prompt_tokens)
        last = computed >= self.num_prompt_tokens
        end = cdiv(self.num_prompt_tokens, block_size) if last else computed // block_size
        # A preempted request computes its first blocks again: they were sent already.
        end = max(end, first)
        if end == first and not last:
            return None
        self.next_block = end
        return first, end, last


@dataclass
class _StepSend:
    """One request's share of one step: per layer group, blocks ``[first, first + len(ids))`` of
    each of the group's layers."""

    export: Export
    request_id: str
    # per group: (first, cache block ids on the cache's device); ids None: no block of the group
    parts: list[tuple[int, torch.Tensor | None]]
    last: bool  # the step completes the prompt: commit after the last layer


class KVExporter:
    """Installs itself as the model runner's layer hook; ``add`` a request's transfer before its
    prompt is queued, ``cancel`` it if the request goes away, ``close`` to stop the sender thread."""

    def __init__(self, runner: ModelRunner, block_size: int, num_layers: int):
        self.runner = runner
        self.block_size = block_size
        self.last_layer = num_layers - 1
        self._exports: dict[str, Export] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = _SenderThread(self._queue)
        runner.layer_hook = self.plan_step

    def add(self, request_id: str, export: Export) -> None:
        with self._lock:
            self._exports[request_id] = export

    def cancel(self, request_id: str, reason: str) -> None:
        """Abort the request's transfer, after whatever the sender thread already holds of it."""
        with self._lock:
            export = self._exports.pop(request_id, None)
        if export is not None:
            self._queue.put(("abort", export, reason))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the sender thread has handed everything queued so far to the sessions."""
        handed = threading.Event()
        self._queue.put(handed)
        return handed.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the sender thread finish what it holds, then stop it."""
        self._sender.stop(timeout_s)

    # ---- engine thread ------------------------------------------------------------------------

    def plan_step(self, items: list[ScheduledRequest]) -> Callable[[int], None] | None:
        """Before a step: which blocks of which transfers it completes; None if none (the runner
        then calls nothing per layer, and a decode-only step may replay a CUDA graph)."""
        if not self._exports:
            return None
        device, groups = self.runner.kv_cache.device, self.runner.groups
        sends = []
        with self._lock:
            for item in items:
                rid = item.request.request_id
                export = self._exports.get(rid)
                part = None if export is None else export.advance(item, self.block_size)
                if part is None:
                    continue
                first, end, last = part
                tables = item.group_block_ids or [item.block_ids]
                parts = []
                for g, table in enumerate(tables):
                    start = max(first, groups.first_block(g, export.num_prompt_tokens, self.block_size))
                    # The cache's device: index_select on a CUDA cache refuses a CPU index.
                    ids = torch.tensor(table[start:end], dtype=torch.long, device=device) if end > start else None
                    parts.append((start, ids))
                sends.append(_StepSend(export, rid, parts, last))
        if not sends:
            return None
        return lambda layer: self._on_layer(layer, sends)

    def _on_layer(self, layer: int, sends: list[_StepSend]) -> None:
        """After ``layer`` wrote this step's KV: snapshot the completed blocks, hand them over."""
        groups = self.runner.groups
        layer_cache = self.runner.kv_cache[groups.layer_slot[layer]]  # [2, blocks, ...]: keys, values
        for s in sends:
            first, ids = s.parts[groups.layer_group[layer]]
            if ids is not None:
                snapshot = layer_cache.index_select(1, ids)
                ready = None
                if snapshot.device.type == "cuda":  # the copy runs on the engine's stream: mark its end
                    ready = torch.cuda.Event()
                    ready.record()
                self._queue.put(("send", s.export, (layer, first, snapshot, ready)))
            if s.last and layer == self.last_layer:
                with self._lock:  # a cancelled transfer never commits; after this, a cancel finds nothing
                    if self._exports.get(s.request_id) is s.export:
                        del self._exports[s.request_id]
                        self._queue.put(("commit", s.export, None))


class _SenderThread:
    """Feeds sessions in the order the engine thread queued their work: serialisation, checksums
    and network queues off the engine thread. A session whose transfer already ended (it failed
    on the receiver's side, or was aborted) gets nothing more."""

    def __init__(self, work: queue.SimpleQueue):
        self._queue = work
        self._stream = None  # CUDA: copies to the host on a stream of their own
        self._thread = threading.Thread(target=self._run, name="kv-export", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        from pdserve.engine.cpu_kernels import keep_thread_serial

        keep_thread_serial()  # its copies are small; an OpenMP team here would slow the engine's (AsyncEngine)
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):  # flush(): everything before it was handed over
                item.set()
                continue
            kind, export, arg = item
            if export.closed:
                continue
            try:
                if kind == "send":
                    if not export.session.done.done():
                        self._send(export.session, *arg)
                elif kind == "commit":
                    export.closed = True
                    export.session.commit()
                else:
                    export.closed = True
                    export.session.abort(arg)
            except Exception as e:  # a session that cannot go on must not stop the others
                log.exception("KV export: %s failed", kind)
                export.closed = True
                export.session.abort(f"KV export failed: {e!r}")

    def _send(self, session: SendSession, layer: int, first: int, snapshot: torch.Tensor, ready) -> None:
        if ready is None:
            session.send_layer(layer, first, snapshot[0], snapshot[1])
            return
        # Wait for the snapshot only, not for the layers the engine queued after it, and let the
        # session's own work (its host copy, a concatenation for NCCL) run on this stream too.
        if self._stream is None:
            self._stream = torch.cuda.Stream(snapshot.device)
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            session.send_layer(layer, first, snapshot[0], snapshot[1])
