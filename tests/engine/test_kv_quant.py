"""KV-cache quantization: quantize/dequantize error, attention over a quantized cache against a
float cache, and an engine running with it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.attention import TorchPagedAttention
from pdserve.engine.kv_quant import (
    KV_CACHE_DTYPES,
    QuantizedKVAttention,
    allocate_quantized_cache,
    layer_views,
    quantize,
)
from pdserve.engine.model_runner import ModelRunner
from tests.conftest import run_to_completion

# Stated tolerances, relative to the largest |x| of each row (int8: half a step of 1/127;
# e4m3: 3 mantissa bits, relative error up to 2^-4 of the value).
ROW_TOLERANCE = {"int8": 0.5 / 127 + 1e-6, "fp8": 1 / 16}
# Attention outputs over a quantized cache vs a float one, max abs error / max |output|.
ATTENTION_TOLERANCE = {"int8": 0.015, "fp8": 0.05}


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantize_round_trip_error(name):
    x = torch.randn(300, 3, 64) * torch.rand(300, 3, 1) * 10
    q, scale = quantize(x, KV_CACHE_DTYPES[name])
    back = q.float() * scale[..., None]
    err = (back - x).abs() / x.abs().amax(-1, keepdim=True)
    assert float(err.max()) <= ROW_TOLERANCE[name]


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_attention_over_a_quantized_cache_is_close_to_float(tiny_model, name):
    """The same step (a prefill chunk over a cached context, plus decodes) through a float and a
    quantized cache: outputs within the stated tolerance."""
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import ScheduledRequest

    cfg = tiny_model.config
    float_runner = ModelRunner(tiny_model.model, 32, 16)
    quant_runner = ModelRunner(tiny_model.model, 32, 16, kv_cache_dtype=name)
    assert isinstance(quant_runner.backend, QuantizedKVAttention)
    kvh, hd, heads = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    # A first step fills 37 + 20 tokens for two requests, a second step reads them back.
    reqs = [Request(f"r{i}", list(range(100, 100 + n)), SamplingParams()) for i, n in enumerate((38, 21))]
    tables = [[0, 1, 2], [5, 6]]
    first = [ScheduledRequest(r, 0, r.num_tokens - 1, t, False) for r, t in zip(reqs, tables)]
    second = [ScheduledRequest(reqs[0], 37, 1, tables[0], True), ScheduledRequest(reqs[1], 20, 1, tables[1], True)]
    for step in (first, second):
        outs = []
        for runner in (float_runner, quant_runner):
            items = sorted(step, key=lambda s: s.num_tokens != 1)
            _, _, meta, _ = runner.prepare_inputs(items)
            t = sum(s.num_tokens for s in items)
            q = torch.randn(t, heads, hd, generator=torch.Generator().manual_seed(t))
            k = torch.randn(t, kvh, hd, generator=torch.Generator().manual_seed(t + 1))
            v = torch.randn(t, kvh, hd, generator=torch.Generator().manual_seed(t + 2))
            k_cache, v_cache = runner.layer_caches[0]
            outs.append(runner.backend.forward(q, k, v, k_cache, v_cache, meta))
        err = float((outs[0] - outs[1]).abs().max() / outs[0].abs().max())
        assert err <= ATTENTION_TOLERANCE[name], err
    assert isinstance(float_runner.backend, TorchPagedAttention)


def test_views_share_the_byte_cache():
    cache = allocate_quantized_cache(2, 4, 3, 16, 8)
    k, v = layer_views(cache, 1, torch.int8, 16, 8)
    k.scale[2, 1, 5] = 0.25
    v.data[3, 2, 15, 7] = -3
    assert k.data.shape == (4, 3, 8, 16) and v.data.shape == (4, 3, 16, 8) and k.scale.shape == (4, 3, 16)
    assert cache[1, 0, 2, 1, 16 * 8 + 5 * 4 : 16 * 8 + 6 * 4].view(torch.float32).item() == 0.25
    assert cache[1, 1, 3, 2, 15 * 8 + 7].view(torch.int8).item() == -3


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_engine_with_a_quantized_cache_runs_and_frees_everything(make_engine, name):
    engine = make_engine(kv_cache_dtype=name, max_num_batched_tokens=32)
    for i in range(5):
        engine.add_request(f"r{i}", list(range(200 + i, 260 + 7 * i)), SamplingParams(temperature=0, max_tokens=12))
    out = run_to_completion(engine)
    assert all(len(t) == 12 for t in out.values())


def test_a_bfloat16_cache_holds_twice_the_blocks_and_serves_through_the_kernels(make_engine):
    """--kv-cache-dtype bfloat16: half a float32 cache's bytes per block (twice the blocks in the same
    memory), the attention backend unchanged (its kernels read the cache in place, attention.py), and
    greedy tokens from it with everything freed at the end."""
    from pdserve.engine.attention import CpuPagedAttention

    floats = make_engine(kv_cache_memory_gb=0.01, num_kv_blocks=None)
    halves = make_engine(kv_cache_memory_gb=0.01, num_kv_blocks=None, kv_cache_dtype="bfloat16")
    assert halves.runner.kv_cache.dtype == torch.bfloat16 and halves.kv_block_bytes * 2 == floats.kv_block_bytes
    assert halves.kv.num_blocks in (2 * floats.kv.num_blocks, 2 * floats.kv.num_blocks + 1)
    assert type(halves.runner.backend) is type(floats.runner.backend) is CpuPagedAttention
    for engine in (floats, halves):
        for i in range(5):
            engine.add_request(f"r{i}", list(range(200 + i, 260 + 7 * i)), SamplingParams(temperature=0, max_tokens=12))
    expected, out = run_to_completion(floats), run_to_completion(halves)
    assert all(len(t) == 12 for t in out.values())
    # bfloat16 keeps 8 bits of mantissa: most greedy tokens still agree with the float32 cache's
    agree = sum(next((i for i, (a, b) in enumerate(zip(out[r], expected[r])) if a != b), 12) for r in out)
    assert agree >= 0.5 * 12 * 5, (out, expected)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_one_byte_cache_on_cpu_is_read_in_place_by_the_kernels(make_engine, default_model, name):
    """--kv-cache-dtype int8 or fp8 on CPU: the C kernels write and read the one-byte blocks in place
    (CpuQuantizedKVAttention); the same requests through the torch path (dequantized copies) give the
    same greedy tokens up to the last bits' drift, and everything is freed at the end."""
    from pdserve.engine.cpu_kernels import load_kernels
    from pdserve.engine.kv_quant import CpuQuantizedKVAttention

    if load_kernels() is None:
        pytest.skip("no C compiler here")
    kernels = make_engine(default_model, kv_cache_dtype=name, max_num_batched_tokens=64)
    torch_path = make_engine(default_model, kv_cache_dtype=name, max_num_batched_tokens=64,
                             attention_backend="torch")
    assert type(kernels.runner.backend) is CpuQuantizedKVAttention
    assert type(torch_path.runner.backend) is QuantizedKVAttention
    assert kernels.runner.backend._takes(kernels.runner.layer_caches[0][1])
    texts = ["The history of the river city begins with a bridge", "Write a short poem about winter light:",
             "Q: What is the capital of France?\nA:", "def fibonacci(n):\n    "]
    prompts = [default_model.tokenizer.encode(t * 4) for t in texts]  # (past one 64-token chunk)
    outs = []
    for engine in (kernels, torch_path):
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        outs.append(run_to_completion(engine))
    assert all(len(t) == 12 for t in outs[0].values())
    agree = sum(next((i for i, (a, b) in enumerate(zip(outs[0][r], outs[1][r])) if a != b), 12) for r in outs[0])
    assert agree >= 0.75 * 12 * len(prompts), outs
