"""Triton kernels for the GPU path: KV store, paged decode and prefill attention, RMSNorm, RoPE.

Each kernel has a launcher below it that takes torch tensors; attention.py's ``triton`` backend
(``triton_attention.py``) and model.py's CUDA branches call the launchers. Without a GPU the
kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported), which is how the tests check them against the torch reference.

The cache is read in place in the engine's layout (attention.py), one layer at a time:

    k_cache [num_blocks, kv_heads, head_dim, block_size]   keys, each block transposed
    v_cache [num_blocks, kv_heads, block_size, head_dim]

so every backend reads and writes the same bytes, and KV shipped between workers (whole blocks,
prefill_worker/export.py) needs no conversion whichever backend either side runs. A transposed
key block is what ``q @ K^T`` wants: the kernels load a ``[head_dim, BLOCK_N]`` tile of it.

A request's blocks are a slice of one flat table of block ids: request ``r`` owns
``block_ids[starts[r]:]``, and token ``t`` of it sits in block ``block_ids[starts[r] + t //
block_size]`` at offset ``t % block_size``. The kernels gather a tile of ``BLOCK_N`` tokens at
once, so BLOCK_N need not equal (or divide) the block size.

Softmax runs in base 2 (``exp2``, scores scaled by ``log2(e)``); float32 models multiply in
full precision (``ieee``, not TF32) so that the GPU path tracks the CPU one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """Whether kernels run under Triton's CPU interpreter (read when kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, least: int = 16) -> int:
    """Tile extent for ``n``: a power of two, at least ``least`` (``tl.dot`` wants 16 on GPUs)."""
    return max(least, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


# ---- KV store -------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k, v, k_cache, v_cache, slot_blocks, slot_offsets,
    skt, skh, skd, svt, svh, svd,  # new keys / values [T, kv_heads, head_dim]
    ckb, ckh, ckd, cks,  # k_cache [blocks, kv_heads, head_dim, block_size]
    cvb, cvh, cvs, cvd,  # v_cache [blocks, kv_heads, block_size, head_dim]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    # Loaded once per head row (the interpreter rejects a mask built from a scalar).
    block = tl.load(slot_blocks + t + 0 * h)  # -1: a padding row of a CUDA graph, nothing to store
    offset = tl.load(slot_offsets + t + 0 * h)
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (block >= 0)
    key = tl.load(k + t * skt + h * skh + d * skd, mask=mask)
    value = tl.load(v + t * svt + h * svh + d * svd, mask=mask)
    tl.store(k_cache + block * ckb + h * ckh + d * ckd + offset * cks, key, mask=mask)
    tl.store(v_cache + block * cvb + h * cvh + offset * cvs + d * cvd, value, mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Write ``k``, ``v`` (``[T, kv_heads, head_dim]``) to their slots; a slot block of -1 is skipped."""
    t, kvh, hd = k.shape
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets, *k.stride(), *v.stride(), *k_cache.stride(),
        *v_cache.stride(), NUM_KV_HEADS=kvh, HEAD_DIM=hd, H_PAD=triton.next_power_of_2(kvh),
        D_PAD=triton.next_power_of_2(hd),
    )


# ---- decode attention: one query token per request, split over the context ------------------


@triton.jit
def _decode_kernel(
    q, k_cache, v_cache, block_ids, starts, lens, out, part_acc, part_m, part_l,
    sqt, sqh, sqd, sot, soh, sod,
    ckb, ckh, ckd, cks, cvb, cvh, cvs, cvd,
    qk_scale,  # softmax scale times log2(e)
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (request r, KV head, split): the GROUP query heads sharing the KV head attend to
    the split's share of the context. One split writes the output; several write partial
    (acc, max, sum) rows that ``_decode_reduce_kernel`` combines."""
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens + r)
    table = tl.load(starts + r)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    qt = tl.load(q + r * sqt + heads[:, None] * sqh + d[None, :] * sqd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(block_ids + table + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = n % BLOCK_SIZE
        kt = tl.load(k_cache + block[None, :] * ckb + kv_head * ckh + d[:, None] * ckd + slot[None, :] * cks,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.dot(qt, kt, input_precision=PRECISION) * qk_scale  # [G_PAD, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_cache + block[:, None] * cvb + kv_head * cvh + slot[:, None] * cvs + d[None, :] * cvd,
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0: a padding row (length 0)
        tl.store(out + r * sot + heads[:, None] * soh + d[None, :] * sod, o.to(out.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        row = (r * NUM_HEADS + heads) * NUM_SPLITS + split  # [G_PAD] rows of the partial buffers
        tl.store(part_acc + row[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_m + row, m_i, mask=g_ok)
        tl.store(part_l + row, l_i, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    out, part_acc, part_m, part_l, sot, soh, sod,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < NUM_SPLITS
    row = (r * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(part_m + row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l + row, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: a padding row
    w = tl.exp2(m - top)
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(part_acc + row[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out + r * sot + h * soh + d * sod, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many programs share one request's context: enough for about two per SM.

    Depends on the batch shape only (not on lengths, which live on the GPU), so a CUDA graph
    captured for a batch size keeps its split count.
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, triton.cdiv(2 * sms, num_seqs * num_kv_heads)))


def paged_decode(
    q: torch.Tensor,  # [n, heads, head_dim], one token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # flat block table of the n requests
    starts: torch.Tensor,  # [n] (or more) offset of each request's blocks in block_ids
    lens: torch.Tensor,  # [n] context length of each, its query token included (0: padding, output 0)
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [n, heads, head_dim], any strides; a new tensor if None
    block_n: int = 64,
) -> torch.Tensor:
    n, num_heads, hd = q.shape
    kvh, bs = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // kvh
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if n == 0:
        return out
    splits = num_splits or decode_splits(n, kvh, q.device)
    d_pad = _pow2(hd)
    if splits > 1:
        part_acc = torch.empty(n * num_heads * splits, d_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(n * num_heads * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(n, kvh, splits)](
        q, k_cache, v_cache, block_ids, starts, lens, out, part_acc, part_m, part_l, *q.stride(), *out.stride(),
        *k_cache.stride(), *v_cache.stride(), scale * LOG2E, NUM_HEADS=num_heads, GROUP=group, G_PAD=_pow2(group),
        HEAD_DIM=hd, D_PAD=d_pad, BLOCK_SIZE=bs, BLOCK_N=block_n, NUM_SPLITS=splits,
        PRECISION=_precision(q.dtype), num_warps=4, num_stages=2,
    )
    if splits > 1:
        _decode_reduce_kernel[(n, num_heads)](
            out, part_acc, part_m, part_l, *out.stride(), NUM_HEADS=num_heads, HEAD_DIM=hd, D_PAD=d_pad,
            NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits),
        )
    return out


# ---- prefill attention: chunks of queries over their cached prefix and themselves -----------


@triton.jit
def _prefill_kernel(
    q, k_cache, v_cache, out, block_ids, table_starts, q_starts, q_lens, ctx_lens,
    sqt, sqh, sqd, sot, soh, sod,
    ckb, ckh, ckd, cks, cvb, cvh, cvs, cvd,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (chunk c, query tile, head). The chunk's KV is already in the cache, so keys
    come from the cache alone; query i of the chunk sits at position ctx + i and sees keys
    0 ..= ctx + i:

        keys:    0 ........ ctx-1 | ctx ...... ctx+len-1
        query i: all of the prefix  | the chunk up to itself
    """
    c = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_lens + c)
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_lens + c)
    q0 = tl.load(q_starts + c)
    table = tl.load(table_starts + c)
    kv_head = h // GROUP

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    i_ok = i < q_len
    d_ok = d < HEAD_DIM
    qt = tl.load(q + (q0 + i)[:, None] * sqt + h * sqh + d[None, :] * sqd, mask=i_ok[:, None] & d_ok[None, :],
                 other=0.0)
    q_pos = ctx + i
    end = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len)  # keys this tile needs: positions < end
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Key 0 is in the first tile and every row sees it, so m_i is finite from then on.
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(block_ids + table + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = n % BLOCK_SIZE
        kt = tl.load(k_cache + block[None, :] * ckb + kv_head * ckh + d[:, None] * ckd + slot[None, :] * cks,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.dot(qt, kt, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_cache + block[:, None] * cvb + kv_head * cvh + slot[:, None] * cvs + d[None, :] * cvd,
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + (q0 + i)[:, None] * sot + h * soh + d[None, :] * sod, o.to(out.dtype.element_ty),
             mask=i_ok[:, None] & d_ok[None, :])


def paged_prefill(
    q: torch.Tensor,  # [T, heads, head_dim]: the chunks' queries (rows q_starts[c] ... + q_lens[c])
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,  # written at the chunks' rows only
    block_ids: torch.Tensor,  # flat block table of the chunks
    table_starts: torch.Tensor,  # [C] offset of each chunk's blocks in block_ids
    q_starts: torch.Tensor,  # [C] first row of each chunk in q
    q_lens: torch.Tensor,  # [C]
    ctx_lens: torch.Tensor,  # [C] tokens before each chunk
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    num_chunks = q_lens.shape[0]
    num_heads, hd = q.shape[1], q.shape[2]
    kvh, bs = k_cache.shape[1], k_cache.shape[3]
    if num_chunks == 0:
        return out
    d_pad = _pow2(hd)
    block_m = 64 if d_pad <= 128 else 32
    grid = (num_chunks, triton.cdiv(max_q_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_ids, table_starts, q_starts, q_lens, ctx_lens, *q.stride(), *out.stride(),
        *k_cache.stride(), *v_cache.stride(), scale * LOG2E, GROUP=num_heads // kvh, HEAD_DIM=hd, D_PAD=d_pad,
        BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=32, PRECISION=_precision(q.dtype), num_warps=4, num_stages=2,
    )
    return out


# ---- RMSNorm (+ residual add) ---------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x, residual, new_residual, weight, out, sx, sr, snr, so, N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    h = tl.load(x + row * sx + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to the activations' dtype before the norm, as the unfused path does.
        h = h + tl.load(residual + row * sr + cols, mask=ok, other=0.0)
        tl.store(new_residual + row * snr + cols, h, mask=ok)
    h = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * so + cols, (h * inv_rms * w).to(out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``(norm(x + residual), x + residual)``, or ``norm(x)`` without a residual, over the last dimension."""
    if x.dim() != 2 or x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        flat = rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), None if residual is None else
                        residual.reshape(-1, x.shape[-1]).contiguous(), weight, eps)
        return flat.view(x.shape) if residual is None else (flat[0].view(x.shape), flat[1].view(x.shape))
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(n)
        res, new_res = (residual, new_residual) if residual is not None else (x, out)  # unread placeholders
        _rms_norm_kernel[(rows,)](
            x, res, new_res, weight, out, x.stride(0), res.stride(0), new_res.stride(0), out.stride(0), n, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=8 if block >= 4096 else 4,
        )
    return out if residual is None else (out, new_residual)


# ---- RoPE on interleaved pairs --------------------------------------------------------------


@triton.jit
def _rope_kernel(
    x, rot, out, sxt, sxh, sxd, srt, sri, src, sot, soh, sod,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """Pair i of every head of token t: (x[2i], x[2i+1]) times cos + i sin of rot[t, i]."""
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (i < HALF)
    base = x + t * sxt + h * sxh
    re = tl.load(base + (2 * i) * sxd, mask=mask, other=0.0).to(tl.float32)
    im = tl.load(base + (2 * i + 1) * sxd, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(rot + t * srt + i * sri, mask=i < HALF, other=0.0)
    sin = tl.load(rot + t * srt + i * sri + src, mask=i < HALF, other=0.0)
    dst = out + t * sot + h * soh
    tl.store(dst + (2 * i) * sod, (re * cos - im * sin).to(out.dtype.element_ty), mask=mask)
    tl.store(dst + (2 * i + 1) * sod, (re * sin + im * cos).to(out.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """model.apply_rope: ``x`` ``[T, heads, head_dim]`` (any strides) rotated by ``rot`` ``[T, 1, head_dim / 2]``
    complex; a new contiguous tensor."""
    t, heads, hd = x.shape
    out = torch.empty(t, heads, hd, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    table = torch.view_as_real(rot)  # [T, 1, hd / 2, 2] float32: (cos, sin)
    _rope_kernel[(t,)](
        x, table, out, *x.stride(), table.stride(0), table.stride(2), table.stride(3), *out.stride(),
        NUM_HEADS=heads, HALF=hd // 2, H_PAD=triton.next_power_of_2(heads),
        HALF_PAD=triton.next_power_of_2(hd // 2),
    )
    return out
