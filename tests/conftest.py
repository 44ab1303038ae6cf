"""Shared fixtures: small real objects (a tiny random Llama, the default model) and leak checks."""

from __future__ import annotations

import os

import pytest
import torch

# Keep test runs steady on a shared 2-core machine.
torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "2")))


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
    """Every block back in the free pool, every ref count zero, no request left behind."""
    pool = engine.kv.pool
    assert not engine.scheduler.requests, f"requests left: {list(engine.scheduler.requests)}"
    assert engine.kv.num_requests() == 0
    assert pool.num_referenced() == 0, "blocks still referenced"
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks


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
