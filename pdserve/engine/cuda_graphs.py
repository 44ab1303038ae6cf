"""Running the model on a CUDA GPU: a step's inputs moved there, decode steps replayed as CUDA graphs.

A decode step is dozens of small kernels per layer; launching them from Python costs more than
they take at small batches. So a decode-only step (every scheduled request computes one token,
no layer hook) of ``n`` requests replays the graph captured for the smallest batch bucket
``B >= n``; other steps run eagerly. A graph is captured the first time its bucket is needed.

The graphs read fixed buffers, one int64 vector on the GPU, shared by every bucket:

    [ input_ids | positions | slot_blocks | slot_offsets | lens | starts     | block ids ... ]
      B           B           B             B              B      B + 1        B * max_blocks

Bucket ``b`` reads the first ``b`` entries of each field (``b + 1`` of starts). A step fills
rows ``0 .. n-1`` and pads rows ``n .. b-1``: slot block -1 (the Triton store skips it), length 0
(attention writes 0), token 0 at position 0. Only the ``triton`` backend knows these
conventions (``supports_cuda_graphs``); with another backend every step runs eagerly.

The hidden states returned for a replayed step are a view of the graph's output, valid until
the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pdserve.engine.attention import AttentionBackend, AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with every tensor on ``device``."""
    moved = {f.name: getattr(meta, f.name).to(device, non_blocking=True) for f in dataclasses.fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    prefills = [dataclasses.replace(c, block_ids=c.block_ids.to(device, non_blocking=True)) for c in meta.prefills]
    return dataclasses.replace(meta, **moved, prefills=prefills)


class CudaGraphRunner:
    def __init__(self, model, layer_caches, backend: AttentionBackend, block_size: int,
                 buckets: tuple[int, ...] = BUCKETS):
        self.model = model
        self.layer_caches = layer_caches
        self.backend = backend
        self.device = next(model.parameters()).device
        self.enabled = self.device.type == "cuda" and getattr(backend, "supports_cuda_graphs", False)
        self.buckets = sorted(buckets)
        b = self.buckets[-1]
        self.max_blocks = b * -(-model.rope.max_positions // block_size)
        self.header = 6 * b + 1
        self.static = torch.zeros(self.header + self.max_blocks, dtype=torch.long, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """The model's hidden states for the step (inputs on the CPU), computed on the GPU."""
        bucket = self.bucket(meta, input_ids.shape[0]) if layer_done is None else None
        if bucket is None:
            dev = self.device
            return self.model(input_ids.to(dev), positions.to(dev), self.layer_caches, to_device(meta, dev),
                              self.backend, layer_done)
        if bucket not in self.graphs:
            self.graphs[bucket] = self.capture(bucket)
        graph, hidden = self.graphs[bucket]
        self.fill(input_ids, positions, meta)
        graph.replay()
        return hidden[: input_ids.shape[0]]

    def bucket(self, meta: AttentionMetadata, n: int) -> int | None:
        """The bucket a step replays, or None to run it eagerly."""
        if not self.enabled or meta.prefills or meta.num_decodes != n or n > self.buckets[-1]:
            return None
        if meta.decode_block_ids.shape[0] > self.max_blocks:
            return None
        return next(b for b in self.buckets if b >= n)

    def views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Bucket ``b``'s inputs: views of the shared buffer (see the module docstring)."""
        big = self.buckets[-1]
        field = [self.static[i * big : i * big + b] for i in range(5)]
        starts = self.static[5 * big : 5 * big + b + 1]
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_blocks=field[2], slot_offsets=field[3], num_decodes=b, decode_block_ids=self.static[self.header :],
            decode_block_req=empty, decode_block_mask=empty.bool(), decode_starts=starts, decode_lens=field[4],
            prefills=[],
        )
        return field[0], field[1], meta

    def fill(self, input_ids, positions, meta: AttentionMetadata) -> None:
        """Copy a step's inputs into the buffer (one host-to-device copy), padding rows after them."""
        big, n = self.buckets[-1], input_ids.shape[0]
        blocks = meta.decode_block_ids.cpu()
        host = torch.zeros(self.header + blocks.shape[0], dtype=torch.long)
        host[2 * big : 3 * big] = -1
        for i, values in enumerate((input_ids, positions, meta.slot_blocks, meta.slot_offsets, meta.decode_lens)):
            host[i * big : i * big + n] = values.cpu()
        host[5 * big : 5 * big + n + 1] = meta.decode_starts.cpu()
        host[5 * big + n + 1 : 6 * big + 1] = blocks.shape[0]  # padding rows own no blocks
        host[self.header :] = blocks
        self.static[: host.shape[0]].copy_(host)

    def capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        input_ids, positions, meta = self.views(b)
        self.static[: self.header].zero_()
        meta.slot_blocks.fill_(-1)  # warm-up and capture runs store nothing
        # Warm up on a side stream (Triton compiles its kernels, cuBLAS picks its algorithms), then capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(input_ids, positions, self.layer_caches, meta, self.backend)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(input_ids, positions, self.layer_caches, meta, self.backend)
        self.pool = graph.pool()
        return graph, hidden
