"""Shipping a prompt's KV out of the engine, layer by layer, while the prefill computes.

The exporter hooks the model runner: after each layer of a step, for every request whose
prefill completes in that step and has a transfer session, it copies that layer's blocks
(beyond the destination's cached prefix) and hands them to the session; after the last layer
it commits. The copy is the serialisation's; the request's blocks may be reused once the step
ends, and nothing reads them after the copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledRequest
from pdserve.kvtransfer.base import SendSession


@dataclass
class Export:
    session: SendSession
    skip_blocks: int  # blocks the destination already has
    num_prompt_tokens: int


class KVExporter:
    def __init__(self, runner: ModelRunner, block_size: int, num_layers: int):
        self.runner = runner
        self.block_size = block_size
        self.last_layer = num_layers - 1
        self._exports: dict[str, Export] = {}
        self._lock = threading.Lock()
        runner.layer_hook = self.on_layer

    def add(self, request_id: str, export: Export) -> None:
        with self._lock:
            self._exports[request_id] = export

    def cancel(self, request_id: str, reason: str) -> None:
        with self._lock:
            export = self._exports.pop(request_id, None)
        if export is not None:
            export.session.abort(reason)

    def on_layer(self, layer: int, items: list[ScheduledRequest]) -> None:
        """Engine thread, after ``layer`` wrote this step's KV."""
        if not self._exports:
            return
        cache = self.runner.kv_cache
        for item in items:
            export = self._exports.get(item.request.request_id)
            if export is None or not item.sample:  # only the step that completes the prompt ships
                continue
            end = cdiv(export.num_prompt_tokens, self.block_size)
            ids = torch.tensor(item.block_ids[export.skip_blocks : end], dtype=torch.long)
            if len(ids):
                export.session.send_layer(layer, export.skip_blocks, cache[layer, 0].index_select(0, ids),
                                          cache[layer, 1].index_select(0, ids))
            if layer == self.last_layer:
                export.session.commit()
                with self._lock:
                    self._exports.pop(item.request.request_id, None)
