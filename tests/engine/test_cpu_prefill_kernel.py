"""The C prefill attention kernel (csrc/cpu_kernels.c) against dense softmax attention.

Chunks from scratch, after cached context (chunked prefill, a prefix hit), windowed (Gemma 3's
local layers), shorter and longer than one task's positions, over a shuffled block table whose
unwritten slots hold NaN, with queries as a strided view into a fused projection (as the model
passes them). The same checks run once more in a fresh process with the kernels built for AVX2,
so an AVX-512 machine also tests the path AVX2-only machines take.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.attention import CpuPagedAttention, PrefillChunk, TorchPagedAttention
from pdserve.engine.cpu_isa import ENV_ISA, ORDER, best_isa, cpu_flags
from pdserve.engine.cpu_kernels import load_kernels

needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="no C compiler here")


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


def paged(keys, values, block_size, seed=0):
    """The keys and values in a shuffled block table, every other slot NaN."""
    total, kv_heads, head_dim = keys.shape
    num = -(-total // block_size)
    table = torch.randperm(num + 3, generator=torch.Generator().manual_seed(seed))[:num]
    k_cache = torch.full((num + 3, kv_heads, head_dim, block_size), float("nan"))
    v_cache = torch.full((num + 3, kv_heads, block_size, head_dim), float("nan"))
    for t in range(total):
        k_cache[table[t // block_size], :, :, t % block_size] = keys[t]
        v_cache[table[t // block_size], :, t % block_size] = values[t]
    return k_cache, v_cache, table


CASES = [  # heads, kv_heads, head_dim, block_size, context_len, query_len, window
    (9, 3, 64, 16, 0, 1, 0),
    (9, 3, 64, 16, 0, 7, 0),
    (9, 3, 64, 16, 0, 300, 0),  # several tasks and softmax steps
    (9, 3, 64, 16, 37, 50, 0),  # after a context that ends inside a block
    (9, 3, 64, 16, 250, 1, 0),
    (9, 3, 64, 32, 96, 200, 0),
    (4, 1, 256, 16, 0, 70, 0),  # Gemma 3 270M's shape
    (4, 1, 256, 16, 40, 90, 32),  # its sliding-window layers
    (4, 1, 256, 16, 0, 100, 16),
    (8, 8, 128, 16, 20, 33, 0),  # no grouping
    (32, 4, 128, 16, 5, 20, 0),  # groups of 8, the most the kernel takes
]


def check_cases() -> None:
    torch.manual_seed(0)
    for heads, kv_heads, head_dim, block_size, context_len, query_len, window in CASES:
        backend = CpuPagedAttention(heads, kv_heads, head_dim)
        assert backend._fits(block_size), (heads, kv_heads, head_dim, block_size)
        total = context_len + query_len
        keys, values = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
        fused = torch.randn(query_len, (heads + 2 * kv_heads) * head_dim)
        q = fused[:, : heads * head_dim].view(query_len, heads, head_dim)  # rows apart, as the model's
        k_cache, v_cache, table = paged(keys, values, block_size)
        chunk = PrefillChunk(0, query_len, context_len, table, window)
        out = backend.prefill(q, keys[context_len:], values[context_len:], k_cache, v_cache, chunk)
        expected = reference(q, keys, values, context_len, window)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_the_prefill_kernel_matches_dense_attention():
    check_cases()


@needs_kernels
def test_the_prefill_kernel_built_for_avx2_matches_too(tmp_path):
    if ORDER.index(best_isa(cpu_flags())) < ORDER.index("avx2"):
        pytest.skip("this processor has no AVX2")
    env = {**os.environ, ENV_ISA: "avx2", "PDSERVE_CACHE_DIR": str(tmp_path)}
    code = "import tests.engine.test_cpu_prefill_kernel as t; t.check_cases()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_kernels
def test_a_shape_the_kernel_does_not_take_goes_through_sdpa():
    """Head size 48 is not a whole number of the kernel's vectors: same answer, from the torch path."""
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
