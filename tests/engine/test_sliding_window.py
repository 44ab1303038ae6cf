"""Sliding-window attention (Gemma 3's local layers) over the paged cache, against dense attention.

Each backend path (prefill from scratch, a prefill chunk after cached context, decode batches,
one decode alone) attends a window of the last W positions; the reference is plain softmax
attention over the whole sequence with the same mask, written out here.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.attention import CpuPagedAttention, TorchPagedAttention, windowed
from pdserve.engine.kv_cache_manager import KVGroups
from pdserve.engine.model_runner import ModelRunner

HEADS, KV_HEADS, HEAD_DIM, BS = 4, 1, 32, 4


def reference(q, k, v, positions, window):
    """Dense attention of queries at ``positions`` over keys 0..len(k)-1, causal and windowed."""
    group = HEADS // KV_HEADS
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, heads, hd]
    scores = torch.einsum("thd,lhd->htl", q, kk) / math.sqrt(HEAD_DIM)
    key_pos = torch.arange(len(k))[None, :]
    qp = torch.tensor(positions)[:, None]
    mask = (key_pos <= qp) & (key_pos > qp - window if window else True)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), vv)


class FakeRequest:
    def __init__(self, tokens):
        self.all_token_ids = tokens


class FakeItem:
    def __init__(self, tokens, start, n, blocks):
        self.request, self.start, self.num_tokens, self.block_ids = FakeRequest(tokens), start, n, blocks
        self.num_spec, self.spec_token_ids = 0, []


def runner_meta(items):
    """The runner's own metadata for these items (prepare_inputs does not touch the model)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = BS
    runner.groups = KVGroups.one(1)
    return ModelRunner.prepare_inputs(runner, items)[2]


@pytest.mark.parametrize("backend_cls", [TorchPagedAttention, CpuPagedAttention])
@pytest.mark.parametrize("window", [0, 5, 8, 13])
def test_windowed_paged_attention_equals_dense(backend_cls, window):
    torch.manual_seed(0)
    backend = backend_cls(HEADS, KV_HEADS, HEAD_DIM)
    lengths = [1, 3, 9, 17, 30]  # contexts shorter than, equal to and longer than the windows
    num_blocks = sum(-(-n // BS) for n in lengths) + 4
    k_cache = torch.full((num_blocks, KV_HEADS, HEAD_DIM, BS), float("nan"))
    v_cache = torch.full((num_blocks, KV_HEADS, BS, HEAD_DIM), float("nan"))
    seqs, next_block = [], 1
    for n in lengths:
        blocks = list(range(next_block, next_block + -(-n // BS)))
        next_block += len(blocks)
        seqs.append((torch.randn(n, HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM),
                     torch.randn(n, KV_HEADS, HEAD_DIM), blocks))
    # 1) each sequence but its last token as a prefill: from scratch, or in two chunks (cached context)
    for q, k, v, blocks in seqs:
        n = len(q) - 1
        if n == 0:
            continue
        cut = n // 2 if n > 6 else 0
        for start, stop in ((0, cut), (cut, n)):
            if stop == start:
                continue
            tokens = list(range(len(q)))
            meta = runner_meta([FakeItem(tokens, start, stop - start, blocks)]) if stop - start > 1 else None
            if meta is None:  # a one-token chunk: the runner calls that a decode
                meta = runner_meta([FakeItem(tokens, start, 1, blocks)])
            meta = windowed(meta, window)
            out = backend.forward(q[start:stop], k[start:stop], v[start:stop], k_cache, v_cache, meta)
            expected = reference(q[start:stop], k[:stop], v[:stop], list(range(start, stop)), window)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # 2) every sequence's last token, decoded in one batch; then the longest alone
    items = [FakeItem(list(range(len(q))), len(q) - 1, 1, blocks) for q, _, _, blocks in seqs]
    for batch in (items, items[-1:]):
        meta = windowed(runner_meta(batch), window)
        chosen = [seqs[items.index(item)] for item in batch]
        q = torch.cat([s[0][-1:] for s in chosen])
        k = torch.cat([s[1][-1:] for s in chosen])
        v = torch.cat([s[2][-1:] for s in chosen])
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
        for row, (sq, sk, sv, _) in enumerate(chosen):
            expected = reference(sq[-1:], sk, sv, [len(sq) - 1], window)
            torch.testing.assert_close(out[row : row + 1], expected, rtol=1e-5, atol=1e-5)


def test_windowed_metadata_leaves_out_blocks_wholly_before_the_window():
    items = [FakeItem(list(range(30)), 29, 1, list(range(8))), FakeItem(list(range(3)), 2, 1, [9])]
    meta = windowed(runner_meta(items), 8)  # request 0 sees positions 22..29: blocks 5, 6, 7
    assert meta.decode_block_ids.tolist() == [5, 6, 7, 9]
    assert meta.decode_starts.tolist() == [0, 3, 4]
    assert meta.decode_block_mask.tolist() == [
        [False, False, True, True], [True, True, True, True], [True, True, False, False],
        [True, True, True, False],
    ]
    assert windowed(runner_meta(items), 0).decode_block_ids.tolist() == list(range(8)) + [9]
