"""The Triton kernels against torch references, under Triton's CPU interpreter when there is no GPU.

Inputs are fresh random float32 tensors of awkward sizes: context lengths that are not multiples
of the block size, one-token sequences, a block size that is not a power of two, a head size
that is not one, GQA ratios 1, 3 and 8. Unwritten cache slots hold NaN, so a kernel that reads
past a request's context fails loudly.

Tolerances (float32): attention outputs within 2e-5 absolute of a float64 reference (outputs are
O(1)); RMSNorm and RoPE within 1e-5; the KV store exact; the tiny model's logits within 1e-4
relative (max abs difference over max abs logit), as the transformers comparison allows.
(conftest.py sets TRITON_INTERPRET=1 before these modules are imported when there is no GPU.)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pdserve.configs import ConfigError  # noqa: E402
from pdserve.engine import triton_kernels as tk  # noqa: E402
from pdserve.engine.attention import AttentionMetadata, get_backend, write_kv  # noqa: E402
from pdserve.engine.config import RopeScaling  # noqa: E402
from pdserve.engine.cuda_graphs import CudaGraphRunner, to_device  # noqa: E402
from pdserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from pdserve.engine.loader import build_model  # noqa: E402
from pdserve.engine.model import RotaryEmbedding, apply_rope  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.request import Request  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.scheduler import ModelOutput, Scheduler  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATTN_TOL = 2e-5


def slots(blocks: torch.Tensor, offsets: torch.Tensor) -> AttentionMetadata:
    """Metadata that only says where new keys and values go (what write_kv reads)."""
    none = torch.empty(0, dtype=torch.long)
    return AttentionMetadata(slot_blocks=blocks, slot_offsets=offsets, num_decodes=0, decode_block_ids=none,
                             decode_block_req=none, decode_block_mask=none.bool(), decode_starts=none,
                             decode_lens=none, prefills=[])


def paged_cache(lengths: list[int], kv_heads: int, head_dim: int, block_size: int, gen: torch.Generator):
    """A NaN-filled cache holding random keys and values for requests of ``lengths`` tokens,
    each on shuffled blocks; returns the caches, each request's block ids and its dense K, V."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3  # some blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, kv_heads, head_dim, block_size), float("nan"))
    v_cache = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"))
    tables, dense, used = [], [], 0
    for n, nb in zip(lengths, needed):
        table = order[used : used + nb]
        used += nb
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        write_kv(k, v, k_cache, v_cache, slots(table[pos // block_size], pos % block_size))
        tables.append(table)
        dense.append((k, v))
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables, dense


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
    """Float64 attention of ``q`` ``[m, heads, D]`` at positions ``context ..`` over ``k, v`` ``[n, kvh, D]``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double().transpose(0, 1), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q @ k.permute(1, 2, 0) / math.sqrt(q.shape[-1])  # [heads, m, n]
    keys, queries = torch.arange(k.shape[0]), context + torch.arange(q.shape[1])
    scores = scores.masked_fill(keys[None, :] > queries[:, None], float("-inf"))
    return (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).float()


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size,splits", [
    (1, 2, 16, 16, 1),
    (3, 2, 20, 6, 3),
    (8, 1, 32, 16, 2),
    (8, 2, 16, 5, 1),
])
def test_decode_matches_reference(group, kv_heads, head_dim, block_size, splits):
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    lengths = [1, 17, block_size, 70, 2]
    k_cache, v_cache, tables, dense = paged_cache(lengths, kv_heads, head_dim, block_size, gen)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0] + [len(t) for t in tables]).cumsum(0)
    out = tk.paged_decode(q.to(DEVICE), k_cache, v_cache, torch.cat(tables).to(DEVICE), starts.to(DEVICE),
                          torch.tensor(lengths, device=DEVICE), 1 / math.sqrt(head_dim), num_splits=splits).cpu()
    for r, (n, (k, v)) in enumerate(zip(lengths, dense)):
        expected = reference(q[r : r + 1], k, v, n - 1)
        torch.testing.assert_close(out[r : r + 1], expected, atol=ATTN_TOL, rtol=0, msg=f"request {r} ({n} tokens)")


def test_decode_padding_rows_give_zeros():
    """A length-0 row (a CUDA graph's padding) reads nothing and outputs 0, split or not."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables, _ = paged_cache([9], 2, 16, 4, gen)
    q = torch.randn(2, 4, 16, generator=gen, device="cpu").to(DEVICE)
    blocks, starts = tables[0].to(DEVICE), torch.tensor([0, 3, 3], device=DEVICE)
    for splits in (1, 2):
        out = tk.paged_decode(q, k_cache, v_cache, blocks, starts, torch.tensor([9, 0], device=DEVICE), 0.25,
                              num_splits=splits)
        assert torch.isfinite(out[0]).all() and (out[1] == 0).all()


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size", [(1, 2, 16, 16), (3, 2, 24, 6), (8, 1, 16, 16)])
def test_prefill_matches_reference(group, kv_heads, head_dim, block_size):
    """Chunks of several requests in one launch: (tokens before the chunk, chunk length)."""
    gen = torch.Generator().manual_seed(group * 10 + head_dim)
    chunks = [(0, 7), (19, 5), (3, 1), (16, 33), (0, 1)]
    k_cache, v_cache, tables, dense = paged_cache([c + n for c, n in chunks], kv_heads, head_dim, block_size, gen)
    heads = kv_heads * group
    rows = 2 + sum(n for _, n in chunks)  # two rows before the chunks, as decode rows would be
    q = torch.randn(rows, heads, head_dim, generator=gen)
    q_starts = (torch.tensor([0] + [n for _, n in chunks]).cumsum(0) + 2)[:-1]
    table_starts = torch.tensor([0] + [len(t) for t in tables]).cumsum(0)[:-1]
    out = torch.zeros(rows, heads, head_dim, device=DEVICE)
    ints = [t.to(DEVICE) for t in (table_starts, q_starts, torch.tensor([n for _, n in chunks]),
                                    torch.tensor([c for c, _ in chunks]))]
    tk.paged_prefill(q.to(DEVICE), k_cache, v_cache, out, torch.cat(tables).to(DEVICE), *ints,
                     max(n for _, n in chunks), 1 / math.sqrt(head_dim))
    out = out.cpu()
    assert (out[:2] == 0).all(), "rows outside the chunks are not written"
    for (ctx, n), start, (k, v) in zip(chunks, q_starts.tolist(), dense):
        expected = reference(q[start : start + n], k, v, ctx)
        torch.testing.assert_close(out[start : start + n], expected, atol=ATTN_TOL, rtol=0, msg=f"chunk {ctx}+{n}")


def test_store_kv_matches_torch_write_and_skips_padding():
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(5, 3, 20, 6, generator=gen)
    v_cache = torch.randn(5, 3, 6, 20, generator=gen)
    qkv = torch.randn(4, 2 * 3 * 20 + 12, generator=gen)  # k, v as strided views, like the model's
    k, v = qkv[:, :60].view(4, 3, 20), qkv[:, 60:120].view(4, 3, 20)
    blocks, offsets = torch.tensor([4, 0, -1, 4]), torch.tensor([5, 0, 3, 1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = blocks >= 0
    write_kv(k[keep], v[keep], expected_k, expected_v, slots(blocks[keep], offsets[keep]))
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    tk.store_kv(k.to(DEVICE), v.to(DEVICE), got_k, got_v, blocks.to(DEVICE), offsets.to(DEVICE))
    assert torch.equal(got_k.cpu(), expected_k) and torch.equal(got_v.cpu(), expected_v)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(with_residual):
    gen = torch.Generator().manual_seed(int(with_residual))
    x, residual = torch.randn(3, 100, generator=gen), torch.randn(3, 100, generator=gen)
    weight = torch.randn(100, generator=gen)
    got = tk.rms_norm(x.to(DEVICE), residual.to(DEVICE) if with_residual else None, weight.to(DEVICE), 1e-5)
    h = x + residual if with_residual else x
    expected = F.rms_norm(h, (100,), weight, 1e-5)
    if with_residual:
        got, new_residual = got
        torch.testing.assert_close(new_residual.cpu(), h, atol=0, rtol=0)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_rope_matches_model():
    gen = torch.Generator().manual_seed(11)
    rope = RotaryEmbedding(24, 64, 500000.0, RopeScaling(factor=8.0, original_max_position_embeddings=16))
    qkv = torch.randn(5, 7 * 24 + 8, generator=gen)
    x = qkv[:, : 6 * 24].view(5, 6, 24)  # q and k heads side by side, rows apart (strided)
    rot = rope(torch.tensor([0, 3, 63, 17, 1]))
    got = tk.rope(x.to(DEVICE), rot.to(DEVICE)).cpu()
    torch.testing.assert_close(got, apply_rope(x, rot), atol=1e-5, rtol=1e-5)  # apply_rope on CPU: torch ops


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_tiny_model_logits_match_torch_backend(tiny_model):
    """The whole tiny model with Triton attention against the torch backend: two requests of
    different lengths, the second prefilled in chunks, then decode steps (block size 4)."""
    model = tiny_model.model
    models = {"torch": model, "triton": model if DEVICE.type == "cpu" else
              build_model(tiny_model.config, dict(model.state_dict()), device=DEVICE)}
    runners = {name: ModelRunner(m, num_blocks=24, block_size=4, attention_backend=name) for name, m in models.items()}
    scheduler = Scheduler(KVCacheManager(24, 4), max_num_batched_tokens=9, max_num_seqs=4)
    gen = torch.Generator().manual_seed(2)
    for i, n in enumerate((6, 13)):
        prompt = torch.randint(0, 49152, (n,), generator=gen).tolist()
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    worst = 0.0
    with torch.inference_mode():
        while scheduler.has_unfinished():
            sched = scheduler.schedule()
            items = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1)
            logits = {}
            for name, runner in runners.items():
                ids, positions, meta, _ = runner.prepare_inputs(items)
                m, dev = models[name], runner.device
                ids, positions, meta = ids.to(dev), positions.to(dev), to_device(meta, dev)
                logits[name] = m.compute_logits(m(ids, positions, runner.layer_caches, meta, runner.backend)).cpu()
            worst = max(worst, rel_err(logits["triton"], logits["torch"]))
            assert worst < 1e-4
            out, row = ModelOutput(), 0
            for item in items:
                row += item.num_tokens
                if item.sample:
                    out.sampled_token_ids[item.request.request_id] = [int(logits["torch"][row - 1].argmax())]
            scheduler.update(sched, out)
    print(f"tiny model, triton vs torch attention: worst relative logit error {worst:.2e}")


def scheduled_inputs(runner: ModelRunner, sched):
    items = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1)  # as ModelRunner.execute orders them
    return items, *runner.prepare_inputs(items)[:3]


def sampled(items, token: int = 7) -> ModelOutput:
    return ModelOutput(sampled_token_ids={i.request.request_id: [token] for i in items if i.sample})


@pytest.mark.skipif(torch.cuda.is_available(), reason="test_cuda_graph_replay_matches_eager covers it")
def test_graph_inputs_padding_matches_eager(tiny_model):
    """The fixed-size, padded inputs a decode CUDA graph replays (cuda_graphs.py) give the same
    hidden states as the step run as it is: here without a graph, to check the padding rows."""
    model = tiny_model.model
    runner = ModelRunner(model, num_blocks=24, block_size=4, attention_backend="triton")
    graphs = CudaGraphRunner(model, runner.layer_caches, runner.backend, block_size=4, buckets=(2, 4))
    scheduler = Scheduler(KVCacheManager(24, 4), max_num_batched_tokens=64, max_num_seqs=4)
    for i, n in enumerate((5, 9, 1)):
        scheduler.add_request(Request(f"r{i}", list(range(100, 100 + n)), SamplingParams(max_tokens=3)))
    with torch.inference_mode():
        sched = scheduler.schedule()  # the prompts
        items, ids, positions, meta = scheduled_inputs(runner, sched)
        model(ids, positions, runner.layer_caches, meta, runner.backend)
        scheduler.update(sched, sampled(items))
        items, ids, positions, meta = scheduled_inputs(runner, scheduler.schedule())  # a token each
        assert meta.num_decodes == 3 and not graphs.enabled  # no CUDA here: forward() runs eagerly
        eager = graphs.forward(ids, positions, meta)
        graphs.fill(ids, positions, meta)
        padded = model(*graphs.views(4)[:2], runner.layer_caches, graphs.views(4)[2], runner.backend)
    torch.testing.assert_close(padded[:3], eager, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU makes the triton backend available")
def test_triton_backend_without_gpu_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        get_backend("triton", 4, 2, 16, "cpu")


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """On a GPU: decode steps replayed from graphs (buckets 1, 2, 4) equal the same steps run eagerly."""
    from pdserve.engine.loader import load_model

    model = load_model("random:tiny", device="cuda", seed=3, progress=False).model
    model.rope.to("cuda")  # build_model leaves a random-weight model's rotary table on the CPU
    runner = ModelRunner(model, num_blocks=24, block_size=4)
    assert type(runner.backend).__name__ == "TritonPagedAttention" and runner.cuda_graphs.enabled
    scheduler = Scheduler(KVCacheManager(24, 4), max_num_batched_tokens=64, max_num_seqs=4)
    for i, n in enumerate((5, 9, 1)):
        scheduler.add_request(Request(f"r{i}", list(range(100, 100 + n)), SamplingParams(max_tokens=4 + i)))
    with torch.inference_mode():
        while scheduler.has_unfinished():
            sched = scheduler.schedule()
            items, ids, positions, meta = scheduled_inputs(runner, sched)
            hidden = runner.cuda_graphs.forward(ids, positions, meta).clone()
            if not meta.prefills:  # a layer hook forces the eager path
                eager = runner.cuda_graphs.forward(ids, positions, meta, layer_done=lambda _: None)
                torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=1e-5)
            scheduler.update(sched, sampled(items))
    assert runner.cuda_graphs.graphs, "no decode step was replayed"
