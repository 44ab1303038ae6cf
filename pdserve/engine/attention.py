"""Paged attention over the KV cache: metadata, the torch (CPU) backend, and the registry.

Cache layout, per layer: ``v_cache`` is ``[num_blocks, num_kv_heads, block_size, head_dim]``
(head-major inside a block, so one block of one head is a contiguous ``[block_size, head_dim]``
matrix) and ``k_cache`` the same with each block transposed, ``[num_blocks, num_kv_heads,
head_dim, block_size]``: a query's scores against a key block are then a plain vector-matrix
product (``q @ K^T`` without a transpose), which the C decode kernel vectorises over slots.

A step's tokens are flattened, decode-like requests (one query token) first:

    tokens:  [ d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ... ]
               one token each     a prompt chunk per prefill request

Decode-like requests are attended in one batch over all their blocks at once ("flat
blocks"), with a softmax that spans the blocks of each request (segment max and sum). No
Python loop runs over them. Each prefill chunk runs through SDPA on its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """A request computing more than one token this step."""

    query_start: int  # index of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens before the chunk (prefix hit or earlier chunks)
    block_ids: torch.Tensor  # blocks covering context_len + query_len tokens
    window: int = 0  # > 0: a query at position p sees keys p - window + 1 .. p only (sliding-window layers)
    _mask: tuple[int, torch.Tensor] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def key_mask(self) -> tuple[int, torch.Tensor]:
        """``(lo, mask)``: the first key position any query sees, and which keys from ``lo`` each
        query sees (causal, within the window). Built once per step: every layer shares it."""
        if self._mask is None:
            ctx, n, window = self.context_len, self.query_len, self.window
            lo = max(0, ctx - window + 1) if window else 0  # keys before the first query's window
            key_pos = torch.arange(lo, ctx + n)[None, :]
            query_pos = (ctx + torch.arange(n))[:, None]
            mask = key_pos <= query_pos
            if window:
                mask &= key_pos > query_pos - window
            self._mask = lo, mask
        return self._mask


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block of each new token's KV slot
    slot_offsets: torch.Tensor  # [T] offset of that slot inside its block
    num_decodes: int  # the first num_decodes tokens are one-token requests
    # Flat blocks of the decode-like requests: every block of request r, request after request.
    decode_block_ids: torch.Tensor  # [NB]
    decode_block_req: torch.Tensor  # [NB] index (0..num_decodes-1) of the request owning the block
    decode_block_mask: torch.Tensor  # [NB, block_size] True where the slot holds a context token
    decode_starts: torch.Tensor  # [num_decodes + 1] request r owns flat blocks [starts[r], starts[r + 1])
    decode_lens: torch.Tensor  # [num_decodes] context length of each, its query token included
    prefills: list[PrefillChunk]
    # > 0: a sliding-window layer's view (see ``windowed``): the flat blocks are only those inside
    # each request's window and decode_block_mask hides the slots before it; decode_lens stay whole.
    window: int = 0


@dataclass
class GroupedMetadata:
    """One step's metadata per KV layer group (see kv_cache_manager.KVGroups): the same tokens,
    positions and masks, each group's own block ids."""

    groups: list[AttentionMetadata]
    layer_group: tuple[int, ...]  # the group of each layer

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_group[layer]]


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The metadata a sliding-window layer attends with: each decode request sees its last
    ``window`` positions (its own included, transformers' ``kv > q - window``), blocks wholly
    before them left out; each prefill chunk carries the window for its mask."""
    if window <= 0:
        return meta
    bs = meta.decode_block_mask.shape[-1]
    req, starts, lens = meta.decode_block_req, meta.decode_starts, meta.decode_lens
    first = (lens - window).clamp_(min=0)  # [D] first visible position of each request
    index = torch.arange(len(req), device=req.device) - starts.index_select(0, req)  # block's place in its table
    keep = (index + 1) * bs > first.index_select(0, req)
    positions = index[keep, None] * bs + torch.arange(bs, device=req.device)[None, :]
    kept_req = req[keep]
    mask = meta.decode_block_mask[keep] & (positions >= first.index_select(0, kept_req)[:, None])
    counts = torch.bincount(kept_req, minlength=len(lens))
    new_starts = torch.zeros_like(starts)
    torch.cumsum(counts, 0, out=new_starts[1:])
    return dataclasses.replace(
        meta, decode_block_ids=meta.decode_block_ids[keep], decode_block_req=kept_req, decode_block_mask=mask,
        decode_starts=new_starts, prefills=[dataclasses.replace(c, window=window) for c in meta.prefills],
        window=window,
    )


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out_dtype: torch.dtype | None = None,  # the output's, where not q's (a bf16 o projection's input:
                                               # model.Attention.bf16_out), rounded as .to rounds
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata):
    """Store the step's new keys and values in their slots (rounded to the cache's dtype: a
    bfloat16 cache under float32 activations)."""
    k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = k.to(k_cache.dtype)
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v.to(v_cache.dtype)


class TorchPagedAttention:
    """Attention through torch ops; the CPU path (and the reference for GPU kernels)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def write(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(k, v, k_cache, v_cache, meta)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out_dtype``: the output's dtype where not q's (bfloat16 for a bf16 o projection; a step with a
        prompt chunk: each value rounded as ``.to`` would round it); a decode-only step returns q's."""
        self.write(k, v, k_cache, v_cache, meta)
        d = meta.num_decodes
        if not meta.prefills and d == q.shape[0]:  # a decode-only step: no copy into a shared output
            return self.decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q, dtype=out_dtype or q.dtype)
        if d:
            out[:d] = self.decode(q[:d], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            sl = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            self.prefill_into(out[sl], q[sl], k[sl], v[sl], k_cache, v_cache, chunk)
        return out

    def prefill_into(self, out, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> None:
        """``prefill``'s answer written into ``out`` (the chunk's rows of the step's output)."""
        out.copy_(self.prefill(q, k, v, k_cache, v_cache, chunk))

    def decode(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """One query token per request, softmax across each request's blocks."""
        n, kvh, g, hd = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        if n == 1 and not meta.window:
            return self._decode_one(q, k_cache, v_cache, meta)
        req = meta.decode_block_req
        kb = k_cache.index_select(0, meta.decode_block_ids).to(q.dtype)  # [NB, kvh, hd, bs] (a bf16 cache widened)
        vb = v_cache.index_select(0, meta.decode_block_ids).to(q.dtype)  # [NB, kvh, bs, hd]
        qb = q.view(n, kvh, g, hd).index_select(0, req)  # [NB, kvh, g, hd]
        scores = torch.matmul(qb, kb).mul_(self.scale)  # [NB, kvh, g, bs]
        outside = ~meta.decode_block_mask
        scores.masked_fill_(outside[:, None, None, :], float("-inf"))
        vb.masked_fill_(outside[:, None, :, None], 0.0)  # unwritten slots may hold NaN: 0 * NaN = NaN
        block_max = scores.amax(-1)  # [NB, kvh, g]
        req_max = torch.full((n, kvh, g), float("-inf"), dtype=q.dtype)
        req_max.scatter_reduce_(0, req[:, None, None].expand_as(block_max), block_max, "amax")
        probs = torch.exp_(scores.sub_(req_max.index_select(0, req).unsqueeze(-1)))
        denom = torch.zeros(n, kvh, g, dtype=q.dtype).index_add_(0, req, probs.sum(-1))
        partial = torch.matmul(probs, vb)  # [NB, kvh, g, hd]
        out = torch.zeros(n, kvh, g, hd, dtype=q.dtype).index_add_(0, req, partial)
        return out.div_(denom.unsqueeze(-1)).view(n, kvh * g, hd)

    def _decode_one(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """A single request: its g query heads per KV head play the part of g query positions."""
        length = int(meta.decode_lens[0])
        keys = _gather_keys(k_cache, meta.decode_block_ids, length).to(q.dtype)  # [kvh, L, hd]
        values = _gather_values(v_cache, meta.decode_block_ids, length).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.view(1, self.num_kv_heads, self.group, self.head_dim), keys[None], values[None], scale=self.scale
        )
        return out.view(1, self.num_heads, self.head_dim)

    def prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A chunk of queries over its context and itself, causally (4-D inputs: SDPA's flash path);
        within ``chunk.window`` positions when it is set. ``dtype``: SDPA's inputs rounded to it
        (bfloat16: oneDNN's AMX kernels where the processor has them), the output back to q's."""
        ctx, n, window = chunk.context_len, chunk.query_len, chunk.window
        if ctx == 0 and (not window or n <= window):
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            total = ctx + n
            if ctx == 0:
                keys, values = k.transpose(0, 1), v.transpose(0, 1)
            else:
                keys = _gather_keys(k_cache, chunk.block_ids, total)
                values = _gather_values(v_cache, chunk.block_ids, total)
            lo, mask = chunk.key_mask()
            keys, values = keys[:, lo:], values[:, lo:]
            causal = False
        to = dtype or q.dtype  # (a cache in another dtype than q's, a bfloat16 one, is widened to q's)
        q, keys, values = (x.to(to) for x in (q.transpose(0, 1), keys, values))
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
            scale=self.scale, enable_gqa=self.group > 1,
        )
        out = out[0].transpose(0, 1)
        return out if dtype is None else out.to(k.dtype)


# How a prefill chunk's two products (scores, values) run on CPU: the C kernel in float32 or with
# bf16 dot products (float32 accumulation), or SDPA on bfloat16 inputs. Only a model whose
# projections already multiply in bfloat16 leaves float32 (CpuPagedAttention.choose_prefill_products).
PREFILL_PRODUCTS = ("float32", "kernel_bf16", "sdpa_bf16")


class CpuPagedAttention(TorchPagedAttention):
    """The torch path, with attention (decode and prefill) and the KV write in C kernels that
    read and write the cache in place.

    Falls back to torch where the kernels cannot be built or do not take the dtype or shape.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        from pdserve.engine.cpu_kernels import load_kernels

        self.kernels = load_kernels()
        # How prefill chunks multiply (PREFILL_PRODUCTS): float32 unless the model's projections multiply
        # in bfloat16 (quantization bf16), when choose_prefill_products measures which is fastest here.
        self.prefill_products = "float32"

    def write(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        from pdserve.engine.cpu_kernels import rows_of_heads, usable_cache, write_kv

        if self.kernels is not None and rows_of_heads(k) and rows_of_heads(v) and usable_cache(k_cache, v_cache):
            write_kv(self.kernels, k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
        else:
            super().write(k, v, k_cache, v_cache, meta)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The C kernel over the cache in place (windowed layers too); the torch path where the
        kernel does not take the shape."""
        from pdserve.engine.cpu_kernels import paged_decode, usable_cache

        if (self.kernels is not None and q.dtype == torch.float32 and usable_cache(k_cache, v_cache)
                and self._fits(v_cache.shape[2])):
            out = paged_decode(self.kernels, q, k_cache, v_cache, meta.decode_block_ids, meta.decode_starts,
                               meta.decode_lens, meta.window, self.scale)
            if out is not None:
                return out
        return super().decode(q, k_cache, v_cache, meta)

    def prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        """The C kernel over the cache in place (chunked, prefix-hit and windowed chunks alike: no
        gathered copy, no mask tensor); SDPA where the kernel does not take the shape."""
        out = self._kernel_prefill(q, k_cache, v_cache, chunk)
        if out is not None:
            return out
        return super().prefill(q, k, v, k_cache, v_cache, chunk,
                               torch.bfloat16 if self.prefill_products == "sdpa_bf16" else None)

    def prefill_into(self, out, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> None:
        """The C kernel writes the chunk's rows of the step's output in place (no copy of the chunk's
        answer into them: ~2% of a 4 x 512-token prefill step with bf16 weights on 2 AMX Xeon cores), in
        float32 or bfloat16 (``forward``'s ``out_dtype``)."""
        from pdserve.engine.cpu_kernels import rows_of_heads

        if (not rows_of_heads(out, (torch.float32, torch.bfloat16))
                or self._kernel_prefill(q, k_cache, v_cache, chunk, out) is None):
            super().prefill_into(out, q, k, v, k_cache, v_cache, chunk)

    def _kernel_prefill(self, q, k_cache, v_cache, chunk: PrefillChunk, out=None) -> torch.Tensor | None:
        """The chunk's attention by the C kernel (into ``out`` when given); None where it does not apply
        (SDPA chosen, a shape or cache it does not take) or could not allocate its scratch."""
        from pdserve.engine.cpu_kernels import paged_prefill, rows_of_heads, usable_cache

        if (self.prefill_products == "sdpa_bf16" or self.kernels is None or not rows_of_heads(q)
                or not usable_cache(k_cache, v_cache) or not self._fits(v_cache.shape[2])):
            return None
        return paged_prefill(self.kernels, q, k_cache, v_cache, chunk.block_ids, chunk.context_len, chunk.window,
                             self.scale, self.prefill_products == "kernel_bf16", out=out)

    def choose_prefill_products(self, block_size: int, threads: int) -> str:
        """For a model whose projections multiply in bfloat16: the fastest of ``PREFILL_PRODUCTS``
        on this machine, measured once (``time_prefill_products``) and kept (``cpu_measured``), so
        every worker on the machine multiplies alike. Which one wins is the processor's: with
        AVX-512 bf16 dot products alone (Zen 4) the kernel's bf16 products beat its float32 ones and
        SDPA in bfloat16 is no faster; with AMX tiles, oneDNN's bfloat16 SDPA is 1.5-2.4x the
        kernel's float32 products, whose bf16 products are slower still (README, CPU paths)."""
        from pdserve.engine.cpu_measured import kept, machine_key

        def timed() -> tuple[str, str]:
            seconds = self.time_prefill_products(block_size)
            return min(seconds, key=seconds.get), "a 512-token chunk, ms: " + ", ".join(
                f"{name} {s * 1e3:.2f}" for name, s in seconds.items())

        # the kernels' build (their sources' hash) too: a choice measured against another kernel is measured anew
        build = Path(self.kernels._name).stem if self.kernels is not None else "no kernels"
        key = machine_key(f"{threads} threads", (self.num_heads, self.num_kv_heads, self.head_dim, block_size), build)
        self.prefill_products = kept("a bf16 model's prefill products", key, timed)
        return self.prefill_products

    def time_prefill_products(self, block_size: int, tokens: int = 512) -> dict[str, float]:
        """The seconds each of ``PREFILL_PRODUCTS`` takes (best of 3 after a first call) on a chunk of
        ``tokens`` new tokens of this model's heads; leaves the fastest chosen."""
        import time

        gen = torch.Generator().manual_seed(0)
        kvh, hd, n = self.num_kv_heads, self.head_dim, tokens
        blocks = -(-n // block_size)
        k_cache = torch.randn(blocks, kvh, hd, block_size, generator=gen)
        v_cache = torch.randn(blocks, kvh, block_size, hd, generator=gen)
        q = torch.randn(n, self.num_heads, hd, generator=gen)
        k, v = torch.randn(n, kvh, hd, generator=gen), torch.randn(n, kvh, hd, generator=gen)
        chunk = PrefillChunk(query_start=0, query_len=n, context_len=0, block_ids=torch.arange(blocks))
        seconds = {}
        for products in PREFILL_PRODUCTS:
            self.prefill_products = products
            runs = []
            for _ in range(4):  # the first builds what the path builds once (oneDNN's kernels)
                start = time.perf_counter()
                self.prefill(q, k, v, k_cache, v_cache, chunk)
                runs.append(time.perf_counter() - start)
            seconds[products] = min(runs[1:])
        self.prefill_products = min(seconds, key=seconds.get)
        return seconds

    def _fits(self, block_size: int) -> bool:
        from pdserve.engine.cpu_kernels import attention_fits

        return attention_fits(self.kernels, self.num_heads, self.num_kv_heads, self.head_dim, block_size)


def _gather_values(v_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` values of a block table as ``[kv_heads, length, head_dim]``."""
    blocks = v_cache.index_select(0, block_ids)  # [nb, kvh, bs, hd]
    nb, kvh, bs, hd = blocks.shape
    return blocks.transpose(0, 1).reshape(kvh, nb * bs, hd)[:, :length]


def _gather_keys(k_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys of a block table as ``[kv_heads, length, head_dim]``."""
    blocks = k_cache.index_select(0, block_ids)  # [nb, kvh, hd, bs]
    nb, kvh, hd, bs = blocks.shape
    return blocks.permute(1, 0, 3, 2).reshape(kvh, nb * bs, hd)[:, :length]


# Backends by name, imported lazily so that GPU kernels load only when chosen.
_BACKENDS: dict[str, str] = {
    "torch": "pdserve.engine.attention:TorchPagedAttention",
    "cpu": "pdserve.engine.attention:CpuPagedAttention",
    "triton": "pdserve.engine.triton_attention:TritonPagedAttention",  # GPUs (or Triton's interpreter)
}


def register_backend(name: str, target: str) -> None:
    _BACKENDS[name] = target


def get_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: str = "cpu"
) -> AttentionBackend:
    if name == "auto":
        name = {"cpu": "cpu", "cuda": "triton"}.get(device, "torch")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    module, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)(num_heads, num_kv_heads, head_dim)
