"""The ``triton`` attention backend: attention.py's paged attention as Triton kernels, for GPUs.

``attention_backend=auto`` picks it when the model is on CUDA; ``triton`` asks for it by name.
Without CUDA it runs only under Triton's CPU interpreter (``TRITON_INTERPRET=1``, which the tests
set); otherwise building it raises ``ConfigError``.

Per layer and step (triton_kernels.py):

    store_kv        the step's new keys and values into their slots (the cache layout is the
                    engine's, so kvtransfer ships the same blocks whatever backend either side runs)
    paged_decode    the one-token requests, GQA heads of a KV head together; at small batches the
                    context is split over several programs, and a second launch combines them
    paged_prefill   every prefill chunk in one launch (speculative verification rows included),
                    over its cached prefix and itself, causally

Decode-only steps on CUDA are replayed from CUDA graphs (cuda_graphs.py); a padding row of a
graph has slot block -1 (nothing stored) and length 0 (output 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.configs import ConfigError
from pdserve.engine.attention import AttentionMetadata, PrefillChunk


def check_usable() -> None:
    """Raise ConfigError unless the Triton kernels can run here (a CUDA GPU, or the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"EngineConfig.attention_backend: 'triton' needs the triton package ({e})") from e
    from pdserve.engine.triton_kernels import interpreting

    if not torch.cuda.is_available() and not interpreting():
        raise ConfigError(
            "EngineConfig.attention_backend: 'triton' needs a CUDA GPU and this machine has none; use auto, cpu "
            "or torch (or set TRITON_INTERPRET=1 to run the kernels in Triton's slow CPU interpreter, for tests)"
        )


@dataclass
class PrefillBatch:
    """The step's prefill chunks as the varlen kernel takes them (built once a step, on q's device)."""

    block_ids: torch.Tensor  # the chunks' block tables, one after another
    table_starts: torch.Tensor  # [C] where each chunk's table begins in block_ids
    q_starts: torch.Tensor  # [C] first row of each chunk in the step's tokens
    q_lens: torch.Tensor  # [C]
    ctx_lens: torch.Tensor  # [C] tokens before each chunk
    max_q_len: int

    @classmethod
    def build(cls, chunks: list[PrefillChunk], device: torch.device) -> PrefillBatch:
        table_starts, offset = [], 0
        for chunk in chunks:
            table_starts.append(offset)
            offset += chunk.block_ids.shape[0]
        ints = torch.tensor(
            [table_starts, [c.query_start for c in chunks], [c.query_len for c in chunks],
             [c.context_len for c in chunks]], dtype=torch.long,
        ).to(device)
        block_ids = torch.cat([c.block_ids.to(device) for c in chunks])
        return cls(block_ids, ints[0], ints[1], ints[2], ints[3], max(c.query_len for c in chunks))


class TritonPagedAttention:
    """The AttentionBackend protocol (attention.py) on Triton kernels."""

    supports_cuda_graphs = True  # decode steps take fixed-size, padded inputs (see the module docstring)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        check_usable()
        from pdserve.engine import triton_kernels

        self.kernels = triton_kernels
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        # Every layer of a step sees the same metadata: its prefill batch is built at the first.
        self._batch_of: tuple[AttentionMetadata, PrefillBatch] | None = None

    def write(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self.kernels.store_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if meta.window:
            raise NotImplementedError("the Triton attention kernels do not mask a sliding window yet (Gemma 3's "
                                      "local layers); serve this model on the CPU (--device cpu)")
        self.write(k, v, k_cache, v_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        if d:
            self.kernels.paged_decode(q[:d], k_cache, v_cache, meta.decode_block_ids, meta.decode_starts,
                                      meta.decode_lens, self.scale, out=out[:d])
        if meta.prefills:
            b = self.prefill_batch(meta, q.device)
            self.kernels.paged_prefill(q, k_cache, v_cache, out, b.block_ids, b.table_starts, b.q_starts, b.q_lens,
                                       b.ctx_lens, b.max_q_len, self.scale)
        return out if out_dtype is None else out.to(out_dtype)

    def prefill_batch(self, meta: AttentionMetadata, device: torch.device) -> PrefillBatch:
        if self._batch_of is None or self._batch_of[0] is not meta:
            self._batch_of = (meta, PrefillBatch.build(meta.prefills, device))
        return self._batch_of[1]
