"""KV-cache quantization: int8 or fp8 (e4m3) keys and values with a scale per token and head.

A quantized cache is one byte tensor ``[layers, 2, blocks, kv_heads, block_size * head_dim +
4 * block_size]``: each (block, head) row holds the block's quantized elements (keys transposed
as in the float cache, see attention.py) followed by its ``block_size`` float32 scales. Blocks
therefore carry their scales with them: prefix caching, preemption and KV transfer move whole
blocks and need to know nothing more (the transfer header's dtype says ``int8``/``fp8``, so a
float worker and a quantized one refuse each other at the handshake).

Scales are per token and head (absmax / 127 for int8, absmax / 448 for e4m3), written with the
token, so a block fills one token at a time without requantizing what is already there.
Attention dequantizes the blocks it reads (``QuantizedKVAttention``), then runs the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.engine.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def row_width(block_size: int, head_dim: int) -> int:
    """Bytes of one (block, head) row: the elements, then one float32 scale per slot."""
    return block_size * head_dim + 4 * block_size


def allocate_quantized_cache(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                             device="cpu") -> torch.Tensor:
    return torch.empty(num_layers, 2, num_blocks, num_kv_heads, row_width(block_size, head_dim), dtype=torch.uint8,
                       device=device)


@dataclass
class QuantCache:
    """One layer's keys or values: quantized elements and their scales (views of the byte cache)."""

    data: torch.Tensor  # keys [blocks, kvh, head_dim, block_size], values [blocks, kvh, block_size, head_dim]
    scale: torch.Tensor  # [blocks, kvh, block_size] float32

    @property
    def shape(self):
        return self.data.shape


def layer_views(cache: torch.Tensor, layer: int, dtype: torch.dtype, block_size: int, head_dim: int):
    """(keys, values) of one layer of a byte cache."""
    n = block_size * head_dim
    nb, kvh = cache.shape[2], cache.shape[3]
    out = []
    for kind in (0, 1):
        rows = cache[layer, kind]  # [nb, kvh, width]
        data = rows[..., :n].view(dtype)
        data = data.view(nb, kvh, head_dim, block_size) if kind == 0 else data.view(nb, kvh, block_size, head_dim)
        out.append(QuantCache(data, rows[..., n:].view(torch.float32)))
    return out[0], out[1]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (quantized, scale ``[...]``) with absmax scaling per row."""
    qmax = _QMAX[dtype]
    scale = x.abs().amax(-1).float().clamp_(min=1e-8) / qmax
    scaled = x.float() / scale[..., None]
    if dtype == torch.int8:
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_keys(k: QuantCache, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks' keys as ``[n, kvh, head_dim, block_size]`` in ``dtype``."""
    return (k.data.index_select(0, block_ids).to(dtype) * k.scale.index_select(0, block_ids)[:, :, None, :])


def dequantize_values(v: QuantCache, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks' values as ``[n, kvh, block_size, head_dim]`` in ``dtype``."""
    return (v.data.index_select(0, block_ids).to(dtype) * v.scale.index_select(0, block_ids)[:, :, :, None])


class QuantizedKVAttention(TorchPagedAttention):
    """The torch attention path over a quantized cache: new keys and values are quantized into
    their slots; the blocks a step reads are dequantized (only those), then attended as usual."""

    def write(self, k, v, k_cache: QuantCache, v_cache: QuantCache, meta: AttentionMetadata) -> None:
        kq, ks = quantize(k, k_cache.data.dtype)  # [T, kvh, hd], [T, kvh]
        vq, vs = quantize(v, v_cache.data.dtype)
        blocks, offsets = meta.slot_blocks, meta.slot_offsets
        k_cache.data[blocks, :, :, offsets] = kq
        k_cache.scale[blocks, :, offsets] = ks
        v_cache.data[blocks, :, offsets] = vq
        v_cache.scale[blocks, :, offsets] = vs

    def decode(self, q, k_cache: QuantCache, v_cache: QuantCache, meta: AttentionMetadata) -> torch.Tensor:
        ids = meta.decode_block_ids
        keys = dequantize_keys(k_cache, ids, q.dtype)
        values = dequantize_values(v_cache, ids, q.dtype)
        local = replace(meta, decode_block_ids=torch.arange(len(ids), device=ids.device))
        return super().decode(q, keys, values, local)

    def prefill(self, q, k, v, k_cache: QuantCache, v_cache: QuantCache, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.context_len == 0:
            return super().prefill(q, k, v, None, None, chunk)
        keys = dequantize_keys(k_cache, chunk.block_ids, q.dtype)
        values = dequantize_values(v_cache, chunk.block_ids, q.dtype)
        local = replace(chunk, block_ids=torch.arange(len(chunk.block_ids), device=chunk.block_ids.device))
        return super().prefill(q, k, v, keys, values, local)


class CpuQuantizedKVAttention(QuantizedKVAttention):
    """An int8 or fp8 (e4m3) cache on CPU read and written in place by the C kernels: the KV write quantizes as
    ``quantize`` does, bit for bit (``cpu_kernels.write_kv``), and decode and prefill chunks read the one-byte
    blocks as they are (e4m3 widened through float16), each key's scale applied to its scores and each
    value's to its probabilities (``csrc/cpu_attention.c``): no dequantized copy of the blocks a decode step
    reads. A prefill chunk's cached context is dequantized once per call (into AMX tiles' pairs for a bf16
    model where the processor has them, else into a float32 copy of the blocks) and its own keys and values
    taken unquantized, as the torch path takes them. Shapes the kernels do not take: the torch path."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        from pdserve.engine.cpu_kernels import load_kernels

        self.kernels = load_kernels()
        self.bf16_products = False  # a bf16 model's prefill products (ModelRunner sets it)

    def _takes(self, v_cache: QuantCache) -> bool:
        """Whether the kernels take this cache (its values' view: ``[blocks, kv_heads, block_size, head_dim]``)."""
        from pdserve.engine.cpu_kernels import attention_fits

        data = v_cache.data
        if self.kernels is None or data.dtype not in (torch.int8, torch.float8_e4m3fn) or not data.is_cpu:
            return False
        return attention_fits(self.kernels, self.num_heads, self.num_kv_heads, self.head_dim, data.shape[2])

    def write(self, k, v, k_cache: QuantCache, v_cache: QuantCache, meta: AttentionMetadata) -> None:
        from pdserve.engine.cpu_kernels import rows_of_heads, write_kv

        if self._takes(v_cache) and rows_of_heads(k) and rows_of_heads(v):
            write_kv(self.kernels, k, v, k_cache.data, v_cache.data, meta.slot_blocks, meta.slot_offsets)
        else:
            super().write(k, v, k_cache, v_cache, meta)

    def decode(self, q, k_cache: QuantCache, v_cache: QuantCache, meta: AttentionMetadata) -> torch.Tensor:
        from pdserve.engine.cpu_kernels import paged_decode

        if self._takes(v_cache) and q.dtype == torch.float32:
            out = paged_decode(self.kernels, q, k_cache.data, v_cache.data, meta.decode_block_ids,
                               meta.decode_starts, meta.decode_lens, meta.window, self.scale)
            if out is not None:
                return out
        return super().decode(q, k_cache, v_cache, meta)

    def prefill(self, q, k, v, k_cache: QuantCache, v_cache: QuantCache, chunk: PrefillChunk) -> torch.Tensor:
        out = self._kernel_prefill(q, k, v, k_cache, v_cache, chunk)
        return out if out is not None else super().prefill(q, k, v, k_cache, v_cache, chunk)

    def prefill_into(self, out, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> None:
        from pdserve.engine.cpu_kernels import rows_of_heads

        if (not rows_of_heads(out, (torch.float32, torch.bfloat16))
                or self._kernel_prefill(q, k, v, k_cache, v_cache, chunk, out) is None):
            super().prefill_into(out, q, k, v, k_cache, v_cache, chunk)

    def _kernel_prefill(self, q, k, v, k_cache: QuantCache, v_cache: QuantCache, chunk: PrefillChunk,
                        out=None) -> torch.Tensor | None:
        """The chunk's attention by the C kernel; with bf16 products on AMX tiles over its own keys and values
        as ``k`` and ``v`` hold them (unquantized, as the torch path and vLLM's attend to a chunk's own), the
        cached context's dequantized."""
        from pdserve.engine.cpu_kernels import paged_prefill, rows_of_heads

        if not self._takes(v_cache) or not rows_of_heads(q):
            return None
        fresh = (k, v) if rows_of_heads(k) and rows_of_heads(v) else None
        return paged_prefill(self.kernels, q, k_cache.data, v_cache.data, chunk.block_ids, chunk.context_len,
                             chunk.window, self.scale, self.bf16_products, out=out, fresh=fresh)
