"""The default model gives the same greedy tokens however the engine batches the work.

One at a time, 16 at once, with prefill in 7-token chunks, with prefix-cache hits, and after
forced preemptions. Where tokens differ, the test measures the top-2 logit margin at the
first difference and accepts only a float near-tie (margin under 1e-3), reporting it.
"""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import assert_no_leaks, run_to_completion

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Name a famous painting.",
    "How do birds fly?",
    "Describe a cat in five words.",
    "What is the boiling point of water?",
    "Suggest a name for a dog.",
    "What is machine learning?",
]
NEW_TOKENS = 24
NEAR_TIE = 1e-3


def make(default_model, **options) -> LLMEngine:
    options.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(load_progress=False, **options), loaded=default_model)


def chat_prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def run(engine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens = run_to_completion(engine)
    assert_no_leaks(engine)
    return [tokens[str(i)] for i in range(len(prompts))]


def top2_margin(engine, context: list[int]) -> float:
    engine.add_request("margin", context, SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    out = [o for o in engine.step() if o.request_id == "margin"][0]
    run_to_completion(engine)
    top = out.new_logprobs[0].top
    return top[0].logprob - top[1].logprob


def assert_same_greedy(engine, prompts, expected, got, label):
    for prompt, want, have in zip(prompts, expected, got):
        if want == have:
            continue
        k = next(i for i, (a, b) in enumerate(zip(want, have)) if a != b)
        margin = top2_margin(engine, prompt + want[:k])
        assert margin < NEAR_TIE, f"{label}: tokens differ at {k} with top-2 margin {margin:.4f}"
        print(f"{label}: near-tie at output token {k}, top-2 margin {margin:.2e}")


@pytest.fixture(scope="module")
def reference(default_model):
    """Each prompt alone, prefix cache off."""
    engine = make(default_model, enable_prefix_caching=False)
    prompts = chat_prompts(engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    return prompts, [run(engine, [p], params)[0] for p in prompts]


@pytest.mark.parametrize(
    "label,options",
    [
        ("16 at once", {}),
        ("7-token chunks", {"max_num_batched_tokens": 7}),
        ("forced preemption", {"num_kv_blocks": 24, "max_num_batched_tokens": 128}),
    ],
)
def test_greedy_is_batch_invariant(default_model, reference, label, options):
    prompts, expected = reference
    engine = make(default_model, **options)
    got = run(engine, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    if label == "forced preemption":
        assert engine.scheduler.num_preemptions > 0
    assert_same_greedy(engine, prompts, expected, got, label)


def test_greedy_with_prefix_cache_hits(default_model, reference):
    prompts, expected = reference
    engine = make(default_model)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    run(engine, prompts[:4], params)  # warm the cache: the system prompt and these questions
    got = run(engine, prompts, params)
    assert engine.stats().prefix_cache_hits > 0
    assert_same_greedy(engine, prompts, expected, got, "prefix hits")


def test_seeded_sampling_alone_or_in_a_batch(default_model):
    engine = make(default_model)
    prompts = chat_prompts(engine)[:4]
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=16) for i in range(4)]
    alone = []
    for p, sp in zip(prompts, seeded):
        engine.add_request("a", p, sp)
        alone.append(run_to_completion(engine)["a"])
    for i, (p, sp) in enumerate(zip(prompts, seeded)):
        engine.add_request(f"s{i}", p, sp)
        engine.add_request(f"noise{i}", p, SamplingParams(temperature=1.0, max_tokens=20))
    batched = run_to_completion(engine)
    assert [batched[f"s{i}"] for i in range(4)] == alone
    assert_no_leaks(engine)


def test_same_seed_same_tokens_different_seed_different_tokens(default_model):
    engine = make(default_model)
    prompt = chat_prompts(engine)[1]
    outs = []
    for seed in (7, 7, 8):
        engine.add_request("x", prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=20))
        outs.append(run_to_completion(engine)["x"])
    assert outs[0] == outs[1] and outs[0] != outs[2]
