"""One block-hash scheme (pdserve/prefix_hash.py), pinned by test vectors that the engine's path and
the router's path must both reproduce: a change to either side, or to the scheme, breaks a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefix_hash import SEED, block_hashes, root_hash
from pdserve.router.prefix_index import key_of, key_of_hex, keys_of_packed, prompt_keys
from tests.conftest import run_to_completion

VECTORS = json.loads((Path(__file__).parent / "data" / "prefix_hash_vectors.json").read_text())
CASES = VECTORS["cases"]


def engine_hashes(case: dict) -> list[str]:
    """What the engine's cache manager computes for a request of the case's tokens and salt."""
    kv = KVCacheManager(num_blocks=8, block_size=case["block_size"], model_fingerprint=case["model_fingerprint"])
    request = Request("r", case["token_ids"], SamplingParams(), cache_salt=case["cache_salt"])
    kv.update_block_hashes(request)
    return [h.hex() for h in request.block_hashes]


def test_the_vectors_are_for_this_seed():
    assert VECTORS["seed"] == SEED.decode()
    assert len(CASES) >= 6 and any(c["block_hashes"] == [] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_engine_path_matches_the_vectors(case):
    assert engine_hashes(case) == case["block_hashes"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_router_path_matches_the_vectors(case):
    args = (case["token_ids"], case["model_fingerprint"], case["block_size"], case["cache_salt"])
    assert root_hash(*args[1:]).hex() == case["root"]
    assert [h.hex() for h in block_hashes(*args)] == case["block_hashes"]
    assert prompt_keys(*args) == [key_of_hex(h) for h in case["block_hashes"]]


def test_router_path_in_a_fresh_interpreter_without_torch():
    """The router computes the vectors without torch (and Python's hash seed plays no part)."""
    code = ("import json, sys\n"
            "from pdserve.prefix_hash import block_hashes\n"
            "cases = json.load(open(sys.argv[1]))['cases']\n"
            "got = [[h.hex() for h in block_hashes(c['token_ids'], c['model_fingerprint'], c['block_size'], "
            "c['cache_salt'])] for c in cases]\n"
            "assert got == [c['block_hashes'] for c in cases], got\n"
            "assert 'torch' not in sys.modules\n")
    path = Path(__file__).parent / "data" / "prefix_hash_vectors.json"
    for seed in ("0", "12345"):
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                              env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr


def test_salts_models_and_block_sizes_never_match():
    tokens = list(range(100, 164))
    variants = [("fp", 16, None), ("fp", 16, "a"), ("fp", 16, "b"), ("fp", 16, "a\x00"), ("fp2", 16, None),
                ("fp", 32, None), ("fp", 8, None), ("", 16, None), ("fp", 16, "fp")]
    seen: dict[bytes, tuple] = {}
    for variant in variants:
        for h in block_hashes(tokens, *variant[:2], variant[2]):
            assert h not in seen, (variant, seen.get(h))
            seen[h] = variant
    # a missing salt and an empty one are one tenant (the engine reads "" as none)
    assert block_hashes(tokens, "fp", 16, "") == block_hashes(tokens, "fp", 16, None)
    # the fields are length-prefixed: moving bytes from the fingerprint to the salt changes the root
    assert root_hash("ab", 16, "c") != root_hash("a", 16, "bc")


def test_the_engine_hashes_with_its_model_fingerprint_and_the_events_match_the_router(make_engine):
    engine = make_engine(num_kv_blocks=32)
    assert engine.kv.model_fingerprint == engine.loaded.fingerprint != ""
    prompt = list(range(5, 5 + 3 * engine.block_size + 2))
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0), cache_salt="tenant")
    run_to_completion(engine)
    stored = [h for e in engine.kv.pool.events.drain() if e.kind == "stored" for h in e.block_hashes]
    expected = block_hashes(prompt, engine.loaded.fingerprint, engine.block_size, "tenant")
    assert stored[:3] == expected
    assert keys_of_packed(b"".join(stored[:3])).tolist() == [key_of(h) for h in expected]
