"""The C attention kernels (csrc/cpu_attention.c) against dense softmax attention.

Prefill: chunks from scratch, after cached context (chunked prefill, a prefix hit), windowed
(Gemma 3's local layers), shorter and longer than one task's positions, over a shuffled block table
whose unwritten slots hold NaN, with queries as a strided view into a fused projection (as the model
passes them); again with bfloat16 products. Decode: batches of requests of mixed lengths (and one
request alone, its heads split across threads), whole and windowed, over one shuffled cache. Both
again over a bfloat16 cache (--kv-cache-dtype bfloat16), against dense attention over the same
bfloat16-rounded keys and values: the arithmetic is float32's, so the bounds are too. The
same checks run once more in a fresh process with the kernels built for AVX2, so an AVX-512 machine
also tests the path AVX2-only machines take.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.attention import (
    PREFILL_PRODUCTS,
    AttentionMetadata,
    CpuPagedAttention,
    PrefillChunk,
    TorchPagedAttention,
    windowed,
)
from pdserve.engine.cpu_isa import ENV_ISA, ORDER, best_isa, cpu_flags
from pdserve.engine.cpu_kernels import load_kernels

needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="no C compiler here")


def amx_tiles() -> bool:
    """Whether the processor has AMX tiles and Linux lends them to this process (ARCH_REQ_XCOMP_PERM,
    Linux 5.16 on): where it does not, the kernels built for them take their other paths."""
    if not {"amx_tile", "amx_bf16"} <= set(cpu_flags()):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA


def reference(q, keys, values, context_len, window):
    """Dense attention of queries at context_len.. over every key, causal (and windowed)."""
    group = q.shape[1] // keys.shape[1]
    kk, vv = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->htl", q.double(), kk.double()) / math.sqrt(q.shape[2])
    key_pos = torch.arange(len(keys))[None, :]
    query_pos = (context_len + torch.arange(len(q)))[:, None]
    mask = (key_pos <= query_pos) & ((key_pos > query_pos - window) if window else True)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), vv.double()).float()


def paged(keys, values, block_size, seed=0, dtype=torch.float32):
    """The keys and values in a shuffled block table, every other slot NaN."""
    k_cache, v_cache, (table,) = paged_batch([(keys, values)], block_size, seed, dtype)
    return k_cache, v_cache, table


def paged_batch(seqs, block_size, seed=0, dtype=torch.float32):
    """Several sequences' keys and values in one cache of ``dtype``, each with its own table of
    shuffled blocks; unwritten slots NaN."""
    _, kv_heads, head_dim = seqs[0][0].shape
    counts = [-(-len(keys) // block_size) for keys, _ in seqs]
    order = torch.randperm(sum(counts) + 3, generator=torch.Generator().manual_seed(seed))
    k_cache = torch.full((len(order), kv_heads, head_dim, block_size), float("nan"), dtype=dtype)
    v_cache = torch.full((len(order), kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    tables, used = [], 0
    for (keys, values), count in zip(seqs, counts):
        table = order[used:used + count]
        used += count
        for t in range(len(keys)):
            k_cache[table[t // block_size], :, :, t % block_size] = keys[t]
            v_cache[table[t // block_size], :, t % block_size] = values[t]
        tables.append(table)
    return k_cache, v_cache, tables


def decode_metadata(tables, lens, block_size, window):
    """The decode part of a step's AttentionMetadata (as the model runner builds it), windowed as a
    sliding-window layer sees it."""
    counts = torch.tensor([len(t) for t in tables])
    starts = torch.zeros(len(tables) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    req = torch.repeat_interleave(torch.arange(len(tables)), counts)
    slot = (torch.arange(len(req)) - starts[req])[:, None] * block_size + torch.arange(block_size)[None, :]
    meta = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.int64), slot_offsets=torch.empty(0, dtype=torch.int64),
        num_decodes=len(tables), decode_block_ids=torch.cat(tables).to(torch.int64), decode_block_req=req,
        decode_block_mask=slot < torch.tensor(lens)[req][:, None], decode_starts=starts,
        decode_lens=torch.tensor(lens, dtype=torch.int64), prefills=[])
    return windowed(meta, window)


PREFILL_CASES = [  # heads, kv_heads, head_dim, block_size, context_len, query_len, window
    (9, 3, 64, 16, 0, 1, 0),
    (9, 3, 64, 16, 0, 7, 0),
    (9, 3, 64, 16, 0, 300, 0),  # several tasks and softmax steps
    (9, 3, 64, 16, 37, 50, 0),  # after a context that ends inside a block
    (9, 3, 64, 16, 250, 1, 0),
    (9, 3, 64, 32, 96, 200, 0),
    (4, 1, 256, 16, 0, 70, 0),  # Gemma 3 270M's shape
    (4, 1, 256, 16, 40, 90, 32),  # its sliding-window layers
    (4, 1, 256, 16, 0, 100, 16),
    (9, 3, 64, 16, 200, 56, 181),  # a window whose first block is not a softmax step's: steps end past the keys
    (8, 8, 128, 16, 20, 33, 0),  # no grouping
    (32, 4, 128, 16, 5, 20, 0),  # groups of 8, the most the kernel takes
]


def rounded(x, dtype):
    """``x`` as a cache of ``dtype`` holds it, back in float32."""
    return x.to(dtype).float()


def check_prefill_cases(products: str = "float32", kv_dtype=torch.float32) -> None:
    """``products``: how the backend multiplies (attention.PREFILL_PRODUCTS); in bfloat16 (8 bits of
    mantissa) the bounds are looser. ``kv_dtype``: the cache's; the reference attends over the
    keys and values as it holds them."""
    torch.manual_seed(0)
    for heads, kv_heads, head_dim, block_size, context_len, query_len, window in PREFILL_CASES:
        backend = CpuPagedAttention(heads, kv_heads, head_dim)
        backend.prefill_products = products
        assert backend._fits(block_size), (heads, kv_heads, head_dim, block_size)
        total = context_len + query_len
        keys, values = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
        fused = torch.randn(query_len, (heads + 2 * kv_heads) * head_dim)
        q = fused[:, : heads * head_dim].view(query_len, heads, head_dim)  # rows apart, as the model's
        k_cache, v_cache, table = paged(keys, values, block_size, dtype=kv_dtype)
        chunk = PrefillChunk(0, query_len, context_len, table, window)
        out = backend.prefill(q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk)
        expected = reference(q, rounded(keys, kv_dtype), rounded(values, kv_dtype), context_len, window)
        if products != "float32":
            assert (out - expected).abs().max() < 0.05  # values of size ~1 after ~100-term sums
            assert (out - expected).pow(2).mean().sqrt() < 0.005
        else:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def chunk_inputs(heads, kv_heads, head_dim, context_len, query_len):
    """A prefill case's keys and values (context and chunk) and the chunk's queries, a view into a fused
    projection's rows (rows apart, as the model passes them)."""
    total = context_len + query_len
    keys, values = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
    q = torch.randn(query_len, (heads + 2 * kv_heads) * head_dim)[:, : heads * head_dim].view(
        query_len, heads, head_dim)
    return keys, values, q


def check_prefill_bf16_out(products: str = "float32", kv_dtype=torch.float32) -> None:
    """The kernel writing its output in bfloat16 (a bf16 o projection's input: ``forward``'s out_dtype) gives
    the float32 output rounded as ``.to`` rounds it, bit for bit, into the chunk's rows of a step's output."""
    torch.manual_seed(1)
    for heads, kv_heads, head_dim, block_size, context_len, query_len, window in PREFILL_CASES:
        backend = CpuPagedAttention(heads, kv_heads, head_dim)
        backend.prefill_products = products
        keys, values, q = chunk_inputs(heads, kv_heads, head_dim, context_len, query_len)
        k_cache, v_cache, table = paged(keys, values, block_size, dtype=kv_dtype)
        chunk = PrefillChunk(0, query_len, context_len, table, window)
        wide = backend.prefill(q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk)
        step = torch.full((query_len + 3, heads, head_dim), 7.0, dtype=torch.bfloat16)  # 3 rows of others
        backend.prefill_into(step[3:], q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk)
        assert torch.equal(step[3:], wide.to(torch.bfloat16)), (heads, head_dim, context_len, query_len, products)
        assert (step[:3] == 7).all()


DECODE_CASES = [  # heads, kv_heads, head_dim, block_size, context lengths, window
    (9, 3, 64, 16, [1, 17, 300, 1000, 128, 129], 0),
    (9, 3, 64, 16, [700], 0),  # one request: its heads split across the threads
    (4, 1, 256, 16, [600, 30, 513, 512], 512),  # Gemma 3 270M's sliding-window layers
    (4, 1, 256, 16, [100, 47], 16),
    (8, 8, 128, 32, [70, 3, 33], 0),
    (32, 4, 128, 16, [40, 129], 0),
]


def check_decode_cases(kv_dtype=torch.float32) -> None:
    torch.manual_seed(0)
    for heads, kv_heads, head_dim, block_size, lens, window in DECODE_CASES:
        backend = CpuPagedAttention(heads, kv_heads, head_dim)
        assert backend._fits(block_size), (heads, kv_heads, head_dim, block_size)
        seqs = [(torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)) for n in lens]
        k_cache, v_cache, tables = paged_batch(seqs, block_size, dtype=kv_dtype)
        q = torch.randn(len(lens), heads, head_dim)
        out = backend.decode(q, k_cache, v_cache, decode_metadata(tables, lens, block_size, window))
        for r, (keys, values) in enumerate(seqs):
            expected = reference(q[r:r + 1], rounded(keys, kv_dtype), rounded(values, kv_dtype), lens[r] - 1, window)
            torch.testing.assert_close(out[r:r + 1], expected, rtol=1e-4, atol=1e-5)


def paged_bytes(seqs, block_size, dtype=torch.int8, seed=0):
    """Several sequences' keys and values in one int8 or fp8 cache (kv_quant.py's layout), each token and head
    quantized as the KV write quantizes them, in shuffled blocks; unwritten slots random bytes with NaN
    scales. Returns the keys' and values' views, the tables, and each sequence's keys and values as the
    cache holds them (dequantized), for the reference."""
    from pdserve.engine.kv_quant import allocate_quantized_cache, layer_views, quantize

    _, kv_heads, head_dim = seqs[0][0].shape
    counts = [-(-len(keys) // block_size) for keys, _ in seqs]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(sum(counts) + 3, generator=gen)
    cache = allocate_quantized_cache(1, len(order), kv_heads, block_size, head_dim)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
    k, v = layer_views(cache, 0, dtype, block_size, head_dim)
    k.scale.fill_(float("nan"))
    v.scale.fill_(float("nan"))
    tables, held, used = [], [], 0
    for (keys, values), count in zip(seqs, counts):
        table = order[used:used + count]
        used += count
        (kq, ks), (vq, vs) = quantize(keys, dtype), quantize(values, dtype)
        for t in range(len(keys)):
            b, o = table[t // block_size], t % block_size
            k.data[b, :, :, o], k.scale[b, :, o] = kq[t], ks[t]
            v.data[b, :, o], v.scale[b, :, o] = vq[t], vs[t]
        tables.append(table)
        held.append((kq.float() * ks[..., None], vq.float() * vs[..., None]))
    return k, v, tables, held


def check_byte_cases(dtype=torch.int8, bf16_products: bool = False) -> None:
    """Prefill chunks and decode batches over an int8 or fp8 cache (--kv-cache-dtype int8 or fp8) through
    the kernels, against dense attention over the keys and values as the cache holds them. Decode multiplies
    the widened bytes and applies each key's scale to its scores and each value's to its probabilities:
    float32's bounds. A prefill chunk attends to its own keys and values unquantized (as the projection gave
    them), the context's as the cache holds them (dequantized into the AMX tiles' pairs, or elsewhere into a
    float32 copy of the blocks): float32's bounds, or with bf16 products (where the kernels have them)
    bfloat16's."""
    from pdserve.engine.kv_quant import CpuQuantizedKVAttention

    torch.manual_seed(2)
    bf16 = bf16_products and load_kernels().paged_prefill_bf16_products() >= 1
    for heads, kv_heads, head_dim, block_size, context_len, query_len, window in PREFILL_CASES:
        backend = CpuQuantizedKVAttention(heads, kv_heads, head_dim)
        backend.bf16_products = bf16_products
        keys, values, q = chunk_inputs(heads, kv_heads, head_dim, context_len, query_len)
        k_cache, v_cache, (table,), ((held_k, held_v),) = paged_bytes([(keys, values)], block_size, dtype)
        chunk = PrefillChunk(0, query_len, context_len, table, window)
        k, v = keys[context_len:], values[context_len:]
        assert backend._kernel_prefill(q, k, v, k_cache, v_cache, chunk) is not None, "the kernel, not torch's path"
        out = backend.prefill(q, k, v, k_cache, v_cache, chunk)
        held_k, held_v = torch.cat([held_k[:context_len], k]), torch.cat([held_v[:context_len], v])
        expected = reference(q, held_k, held_v, context_len, window)
        if bf16:  # (tighter than check_prefill_cases': a chunk's own keys read from an fp8 cache miss them)
            assert (out - expected).abs().max() < 0.02
            assert (out - expected).pow(2).mean().sqrt() < 0.002
        else:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for heads, kv_heads, head_dim, block_size, lens, window in DECODE_CASES:
        backend = CpuQuantizedKVAttention(heads, kv_heads, head_dim)
        seqs = [(torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)) for n in lens]
        k_cache, v_cache, tables, held = paged_bytes(seqs, block_size, dtype)
        assert backend._takes(v_cache), "the kernel, not torch's path"
        q = torch.randn(len(lens), heads, head_dim)
        out = backend.decode(q, k_cache, v_cache, decode_metadata(tables, lens, block_size, window))
        for r, (held_k, held_v) in enumerate(held):
            expected = reference(q[r:r + 1], held_k, held_v, lens[r] - 1, window)
            torch.testing.assert_close(out[r:r + 1], expected, rtol=1e-4, atol=1e-5)


def check_cases() -> None:
    check_prefill_cases()
    check_decode_cases()
    check_prefill_cases("kernel_bf16")  # AVX2: the float32 products (the kernels have no bf16 here)
    check_prefill_cases(kv_dtype=torch.bfloat16)
    check_decode_cases(torch.bfloat16)
    check_prefill_bf16_out("kernel_bf16", torch.bfloat16)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        check_byte_cases(dtype)
        check_byte_cases(dtype, bf16_products=True)  # AVX2: the float32 products


@needs_kernels
def test_the_prefill_kernel_matches_dense_attention():
    check_prefill_cases()


@needs_kernels
def test_the_prefill_kernel_in_bfloat16_products_stays_close():
    """Where the processor has bf16 dot products the kernels are built with them and a bf16 model's
    prefill uses them (the answer then differs from float32's, within bfloat16's precision)."""
    isa = load_kernels().isa  # (the ISA the kernels were built for, whatever the environment says since)
    if "avx512_bf16" in cpu_flags() and isa in ("avx512_bf16", "amx"):
        # 2: on AMX tiles, where the processor has them and the ISA is not capped below them
        amx = amx_tiles() and isa != "avx512_bf16"
        assert load_kernels().paged_prefill_bf16_products() == (2 if amx else 1)
    check_prefill_cases("kernel_bf16")


@needs_kernels
@pytest.mark.parametrize("products, kv_dtype", [("float32", torch.float32), ("kernel_bf16", torch.bfloat16)])
def test_the_prefill_kernel_writes_a_bfloat16_output_as_torch_rounds_its_float32_one(products, kv_dtype):
    check_prefill_bf16_out(products, kv_dtype)


@needs_kernels
@pytest.mark.skipif(not amx_tiles(), reason="no AMX tiles on this processor (or Linux does not lend them)")
def test_the_amx_products_equal_the_bf16_dot_products(tmp_path):
    """On AMX tiles a bf16 model's prefill attention multiplies the same bfloat16 pairs as with
    vdpbf16ps; only the order of the float32 sums differs, which moves a score by an ulp and, now
    and then, a probability across a bfloat16 rounding step (both sides also stay close to float32:
    the cases above, where the two are equally far from it). The vdpbf16ps side runs in a child
    process with PDSERVE_AMX_OFF=1."""
    script = '''
import sys, torch
from pdserve.engine.attention import CpuPagedAttention, PrefillChunk
from pdserve.engine.cpu_kernels import load_kernels
sys.path.insert(0, sys.argv[2])
from test_cpu_attention_kernels import PREFILL_CASES, paged
torch.manual_seed(0)
outs = []
for heads, kv_heads, head_dim, block_size, context_len, query_len, window in PREFILL_CASES:
    for kv_dtype in (torch.float32, torch.bfloat16):
        backend = CpuPagedAttention(heads, kv_heads, head_dim)
        backend.prefill_products = "kernel_bf16"
        total = context_len + query_len
        keys, values = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
        q = torch.randn(query_len, heads, head_dim)
        k_cache, v_cache, table = paged(keys, values, block_size, dtype=kv_dtype)
        chunk = PrefillChunk(0, query_len, context_len, table, window)
        outs.append(backend.prefill(q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk))
torch.save({"products": load_kernels().paged_prefill_bf16_products(), "outs": outs}, sys.argv[1])
'''
    results = {}
    for name, off in (("amx", "0"), ("vdpbf16ps", "1")):
        env = {**os.environ, "PDSERVE_AMX_OFF": off, ENV_ISA: "amx"}
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name), os.path.dirname(__file__)], env=env,
                       check=True)
        results[name] = torch.load(tmp_path / name)
    assert results["amx"]["products"] == 2 and results["vdpbf16ps"]["products"] == 1
    for a, b in zip(results["amx"]["outs"], results["vdpbf16ps"]["outs"], strict=True):
        assert torch.isfinite(a).all()
        diff = (a - b).abs()
        print(f"max {diff.max():.2e} mean {diff.mean():.2e} differing {(diff > 1e-5).float().mean():.2%}")
        assert diff.max() < 2e-3 and diff.mean() < 5e-5  # (a flip moves an output by ~2^-9 p v: long rows flip more)


def test_prefill_through_sdpa_in_bfloat16_stays_close():
    """The third way a bf16 model's prefill may multiply (oneDNN's bfloat16 SDPA, AMX's): chunks
    with and without context, windows, groups, within bfloat16's precision."""
    check_prefill_cases("sdpa_bf16")


def test_a_bf16_model_keeps_the_fastest_prefill_products(tmp_path, monkeypatch):
    backend = CpuPagedAttention(9, 3, 64)
    seconds = backend.time_prefill_products(16, tokens=64)
    assert set(seconds) == set(PREFILL_PRODUCTS) and all(s > 0 for s in seconds.values())
    assert backend.prefill_products == min(seconds, key=seconds.get)
    # once per machine: the first choice is kept, and a second backend reads it without timing
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = backend.choose_prefill_products(16, 1)
    again = CpuPagedAttention(9, 3, 64)
    monkeypatch.setattr(again, "time_prefill_products", lambda *a: pytest.fail("measured twice"))
    assert again.choose_prefill_products(16, 1) == first in PREFILL_PRODUCTS


@needs_kernels
def test_the_decode_kernel_matches_dense_attention():
    check_decode_cases()


@needs_kernels
def test_the_kernels_read_a_bfloat16_cache_in_place():
    """--kv-cache-dtype bfloat16: decode and prefill (float32 and bf16 products) over a bfloat16 cache,
    widened as it is read; the kernels, not torch's path (which would gather a float32 copy)."""
    check_prefill_cases(kv_dtype=torch.bfloat16)
    check_prefill_cases("kernel_bf16", kv_dtype=torch.bfloat16)
    check_decode_cases(torch.bfloat16)


def write_case(first_offset: int, magnitude: float, tokens: int = 40, kv_heads: int = 3, head_dim: int = 64,
               block_size: int = 16):
    """A KV write's inputs: ``tokens`` keys and values of ``magnitude`` (rows apart in a fused projection, as
    the model's) for slots from ``first_offset`` on in 4 of 8 shuffled blocks, and the step's metadata."""
    fused = torch.randn(tokens, (3 + 2 * kv_heads) * head_dim) * magnitude
    k = fused[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    blocks = torch.randperm(8)[:4].repeat_interleave(block_size)[first_offset: first_offset + tokens]
    offsets = (torch.arange(tokens) + first_offset) % block_size
    none = blocks[:0]
    meta = AttentionMetadata(slot_blocks=blocks, slot_offsets=offsets, num_decodes=0, decode_block_ids=none,
                             decode_block_req=none, decode_block_mask=torch.empty(0, block_size, dtype=torch.bool),
                             decode_starts=blocks[:1], decode_lens=none, prefills=[])
    return k, v, meta


@needs_kernels
@pytest.mark.parametrize("first_offset", [0, 8])
def test_the_kv_write_rounds_into_a_bfloat16_cache_as_torch_does(first_offset):
    """write_kv_bf16: every key and value rounded to nearest even, as torch's own assignment (the
    torch path's) rounds, infinities and NaN included; other slots untouched. Tokens starting at a
    block's first slot fill whole blocks 16 at a time (the kernel's gathered path), and starting
    halfway, every 16 of them straddle two blocks (its token-by-token path)."""
    torch.manual_seed(0)
    kv_heads, head_dim, block_size, tokens = 3, 64, 16, 40
    k, v, meta = write_case(first_offset, 100)
    k[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1 + 2 ** -8])  # a tie, to even
    caches = []
    for backend in (CpuPagedAttention(9, kv_heads, head_dim), TorchPagedAttention(9, kv_heads, head_dim)):
        k_cache = torch.zeros(8, kv_heads, head_dim, block_size, dtype=torch.bfloat16)
        v_cache = torch.zeros(8, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
        backend.write(k, v, k_cache, v_cache, meta)
        caches.append((k_cache, v_cache))
    for kernel, torch_path in zip(*caches):  # (NaN's bits differ between torch's own paths: any NaN)
        torch.testing.assert_close(kernel, torch_path, rtol=0, atol=0, equal_nan=True)
    assert caches[0][0].ne(0).sum() == tokens * kv_heads * head_dim and caches[0][0].isnan().sum() == 1


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_the_kernels_read_a_one_byte_cache_in_place(dtype):
    """--kv-cache-dtype int8 or fp8: decode reads the one-byte blocks and their scales as they are
    (kv_quant.CpuQuantizedKVAttention), prefill them dequantized with the chunk's own keys and values
    unquantized, with float32 products and, for a bf16 model, bf16 ones (on AMX tiles where this processor
    lends them, else vdpbf16ps where it has them, else float32)."""
    check_byte_cases(dtype)
    check_byte_cases(dtype, bf16_products=True)


@needs_kernels
@pytest.mark.parametrize("first_offset", [0, 8])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_the_kv_write_quantizes_into_a_one_byte_cache_as_torch_does(first_offset, dtype):
    """write_kv_i8 / write_kv_f8: every token's key and value of each head quantized as kv_quant.quantize
    quantizes them (the torch path's write), bytes and scales bit for bit, an all-zero row, a tie and
    fp8's subnormals included; the other slots' bytes untouched."""
    from pdserve.engine.kv_quant import (
        CpuQuantizedKVAttention,
        QuantizedKVAttention,
        allocate_quantized_cache,
        layer_views,
    )

    torch.manual_seed(0)
    kv_heads, head_dim, block_size = 3, 64, 16
    k, v, meta = write_case(first_offset, 10)
    blocks, offsets = meta.slot_blocks, meta.slot_offsets
    k[1, 0] = 0.0  # the scale's floor
    k[2, 1, :2] = torch.tensor([127.0, 0.5])  # int8: scale 1, 0.5 a tie, to even (0)
    # fp8: a row of absmax 1 from 2^-20 up (scaled by 448: zeros, e4m3's subnormals, normals), -0 and a tie
    v[3, 2] = torch.logspace(-20, 0, head_dim, base=2) * torch.tensor([1.0, -1.0]).repeat(head_dim // 2)
    v[4, 0, :3] = torch.tensor([448.0, -1e-9, 448 * (1 + 2 ** -4) / 2])
    caches = []
    for backend in (CpuQuantizedKVAttention(9, kv_heads, head_dim), QuantizedKVAttention(9, kv_heads, head_dim)):
        cache = allocate_quantized_cache(1, 8, kv_heads, block_size, head_dim).fill_(0x5a)
        k_cache, v_cache = layer_views(cache, 0, dtype, block_size, head_dim)
        backend.write(k, v, k_cache, v_cache, meta)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])  # (both from the same bytes: the same slots written, no others)
    k_cache, _ = layer_views(caches[0], 0, dtype, block_size, head_dim)
    qmax = 127 if dtype == torch.int8 else 448
    assert k_cache.scale[blocks[1], 0, offsets[1]] == torch.tensor(1e-8) / qmax
    if dtype == torch.int8:
        assert k_cache.data[blocks[2], 1, :2, offsets[2]].tolist() == [127, 0]


@needs_kernels
def test_the_kernels_built_for_avx2_match_too(tmp_path):
    if ORDER.index(best_isa(cpu_flags())) < ORDER.index("avx2"):
        pytest.skip("this processor has no AVX2")
    env = {**os.environ, ENV_ISA: "avx2", "PDSERVE_CACHE_DIR": str(tmp_path)}
    code = "import tests.engine.test_cpu_attention_kernels as t; t.check_cases()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_kernels
def test_a_shape_the_kernels_do_not_take_goes_through_torch():
    """Head size 48 is not a whole number of the kernels' vectors: same answers, from the torch path."""
    heads, kv_heads, head_dim, block_size = 6, 2, 48, 16
    backend = CpuPagedAttention(heads, kv_heads, head_dim)
    assert not backend._fits(block_size)
    keys, values, q = torch.randn(40, kv_heads, head_dim), torch.randn(40, kv_heads, head_dim), torch.randn(24, heads,
                                                                                                              head_dim)
    k_cache, v_cache, table = paged(keys, values, block_size)
    chunk = PrefillChunk(0, 24, 16, table)
    out = backend.prefill(q, keys[16:], values[16:], k_cache, v_cache, chunk)
    torch.testing.assert_close(out, TorchPagedAttention(heads, kv_heads, head_dim).prefill(
        q, keys[16:], values[16:], k_cache, v_cache, chunk))
    torch.testing.assert_close(out, reference(q, keys, values, 16, 0), rtol=1e-4, atol=1e-5)
    meta = decode_metadata([table], [40], block_size, 0)
    out = backend.decode(q[:1], k_cache, v_cache, meta)
    torch.testing.assert_close(out, reference(q[:1], keys, values, 39, 0), rtol=1e-4, atol=1e-5)
