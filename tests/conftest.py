"""Shared fixtures: small real objects (a tiny random Llama, the default model) and leak checks."""

from __future__ import annotations

import os

import pytest
import torch

# One torch thread in the test process and, through OMP_NUM_THREADS (inherited), in the worker
# processes the tests start, unless a worker is given its own count. On a 2-core machine with
# other load beside it, two threads per process wait on each other at every parallel region:
# a model-heavy subset took 124 s with two threads and 76 s with one beside two busy loops,
# and 50 s either way on a quiet machine.
_TEST_THREADS = os.environ.get("PDSERVE_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", _TEST_THREADS)
torch.set_num_threads(int(_TEST_THREADS))

# No start-up warm-up of the engines (EngineConfig.warmup) in the tests, in process or in the worker
# processes they start (inherited): the suite builds many short-lived engines of the default model, each
# of which would spend seconds building oneDNN kernels for step sizes it never runs. The tests of the
# warm-up itself ask for it.
os.environ.setdefault("PDSERVE_WARMUP", "0")

# Without a GPU, Triton kernels run in its CPU interpreter, which must be chosen before any
# kernel module is imported (tests/engine/test_triton_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct), loaded once per session."""
    from pdserve.engine.loader import load_model

    return load_model(progress=False)


def assert_no_leaks(engine) -> None:
    """Every block back in the free pool, every ref count zero, no request left behind (a cache
    with layer groups keeps its null block)."""
    pool = engine.kv.pool
    kept = [] if engine.kv.null_block is None else [engine.kv.null_block]
    assert not engine.scheduler.requests, f"requests left: {list(engine.scheduler.requests)}"
    assert engine.kv.num_requests() == 0
    assert pool.num_referenced() == len(kept), "blocks still referenced"
    assert all(b.ref_cnt == 0 for b in pool.blocks if b not in kept)
    assert pool.num_free_blocks == pool.num_blocks - len(kept)


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny random-weight Llama (2 layers, hidden 64) with the default model's tokenizer."""
    from pdserve.engine.loader import load_model

    return load_model("random:tiny", progress=False, seed=3)


@pytest.fixture
def make_engine(tiny_model):
    """Build engines over the tiny model; each engine is leak-checked when the test ends."""
    from pdserve.engine import EngineConfig, LLMEngine

    engines = []

    def make(loaded=None, **options):
        loaded = loaded or tiny_model
        options.setdefault("num_kv_blocks", 256)
        config = EngineConfig(model=loaded.source.name, load_progress=False, **options)
        engine = LLMEngine(config, loaded=loaded)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_no_leaks(engine)


def run_to_completion(engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until nothing is left; the output token ids of every request."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


NEAR_TIE = 1e-3


def top2_margin(engine, context: list[int]) -> float:
    """Logit gap between the two most likely next tokens after ``context`` (raw logprobs)."""
    from pdserve.engine import SamplingParams

    engine.add_request("margin-probe", context, SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    out = [o for o in engine.step() if o.request_id == "margin-probe"][0]
    run_to_completion(engine)
    top = out.new_logprobs[0].top
    return top[0].logprob - top[1].logprob


def greedy_reference(engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[str]]:
    """Greedy tokens and the text after each token, from an in-process engine."""
    from pdserve.engine import SamplingParams

    engine.add_request("ref", prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    ids, texts, text = [], [], ""
    while engine.has_unfinished():
        for o in engine.step():
            for t in o.new_token_ids:
                ids.append(t)
            text += o.new_text
            texts.append(text)
    return ids, texts


def assert_text_matches_greedy(engine, prompt_ids: list[int], got: str, max_tokens: int, label: str = "") -> None:
    """``got`` equals the engine's greedy text, or differs first where the top-2 margin is a near-tie."""
    ids, texts = greedy_reference(engine, prompt_ids, max_tokens)
    expected = texts[-1] if texts else ""
    if got == expected:
        return
    k = next((i for i, t in enumerate(texts) if not got.startswith(t)), len(texts))
    margin = top2_margin(engine, prompt_ids + ids[:k])
    assert margin < NEAR_TIE, f"{label}: text differs from greedy at token {k} (top-2 margin {margin:.4f}): " \
                              f"{got!r} vs {expected!r}"
    print(f"{label}: near-tie at token {k}, top-2 margin {margin:.2e}")
