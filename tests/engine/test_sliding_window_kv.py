"""The sliding-window KV cache (block tables per layer group): a sliding-window layer's blocks
wholly before its window go back to the pool as decoding moves on, and every path that reads or
moves the cache gives the same tokens as a cache that keeps every block: chunked prefill, prefix
hits, preemption, speculative decoding and disaggregated transfer (which ships only the blocks
the receiving side keeps)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.config import PRESETS
from pdserve.engine.kv_cache_manager import HybridKVCacheManager, KVGroups, cdiv, kv_groups
from pdserve.engine.loader import load_model
from pdserve.kvtransfer.base import TransferState
from pdserve.kvtransfer.local import LocalHub, LocalSender
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.prefill_worker.export import Export, KVExporter
from tests.conftest import assert_no_leaks, run_to_completion
from tests.kvtransfer.test_local_backend import disaggregated, layout_of

BS, WINDOW = 4, 24  # the tiny Gemma 3's window: 6 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma():
    """Three layers: two sliding-window (window 24), one global; random weights."""
    return load_model("random:tiny-gemma3", progress=False, seed=5)


@pytest.fixture
def make(tiny_gemma):
    engines = []

    def build(**options):
        options.setdefault("num_kv_blocks", 400)
        options.setdefault("block_size", BS)
        engine = LLMEngine(EngineConfig(model=tiny_gemma.source.name, load_progress=False, **options),
                           loaded=tiny_gemma)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        assert_no_leaks(engine)


def prompts():
    shared = list(range(1000, 1050))  # longer than the window: a prefix hit must bring its window
    return [list(range(2000, 2070)), shared + [5, 6, 7], shared + list(range(300, 340)), list(range(400, 409))]


def generate(engine, ps, params=GREEDY):
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    return run_to_completion(engine)


def test_layer_groups():
    """Gemma 3 270M: 3 global and 15 local layers in groups of 3, the global group first; a model
    without sliding-window layers, or the option off, keeps one group."""
    groups = kv_groups(PRESETS["gemma-3-270m"])
    assert groups.windows == (0, 512, 512, 512, 512, 512)
    assert [layer for layer in range(18) if groups.layer_group[layer] == 0] == [5, 11, 17]
    assert groups.num_slots == 3
    assert groups.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert kv_groups(PRESETS["gemma-3-270m"], sliding_window_kv=False) == KVGroups.one(18)
    assert kv_groups(PRESETS["smollm2-135m"]) == KVGroups.one(30)
    assert groups.first_block(1, 600, 16) == (600 - 512 + 1) // 16 and groups.first_block(0, 600, 16) == 0


def test_blocks_before_the_window_are_freed_while_decoding(make):
    """At every step a local group's table holds no block wholly before the window of the next
    position, and at most the window's blocks plus a chunk's; the global group keeps every block;
    the tokens are those of a cache that keeps every block."""
    prompt = list(range(3000, 3060))
    expected = generate(make(sliding_window_kv=False), [prompt])
    engine = make(max_num_batched_tokens=16)
    assert isinstance(engine.kv, HybridKVCacheManager)
    engine.add_request("r0", prompt, GREEDY)
    tokens, steps, position = [], 0, 0
    while engine.has_unfinished():
        for out in engine.step():  # its first query was at ``position``: the window's blocks from there on
            tokens += out.new_token_ids
        steps += 1
        request = engine.scheduler.requests.get("r0")
        if request is None:
            break
        tables = engine.kv.group_block_ids("r0")
        null = engine.kv.null_block.block_id
        first = max(0, position - WINDOW + 1) // BS
        assert len(tables[0]) == cdiv(request.num_computed_tokens, BS) and null not in tables[0]
        for table in tables[1:]:
            assert all(b == null for b in table[:first]), f"step {steps}: a block before the window is held"
            assert sum(b != null for b in table) <= WINDOW // BS + 16 // BS + 1
        position = request.num_computed_tokens
    assert tokens == expected["r0"]
    assert steps > 30


@pytest.mark.parametrize("options", [
    {},  # one chunk per prompt
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"kv_cache_dtype": "int8"},  # a quantized cache: its slots per group as well
    {"attention_backend": "torch"},  # the torch path reads the tables' null entries, masked
])
def test_same_tokens_as_a_cache_that_keeps_every_block(make, options):
    ps = prompts()
    expected = generate(make(sliding_window_kv=False, **options), ps)
    assert generate(make(**options), ps) == expected


def test_preemption_with_layer_groups(make):
    """Four requests admitted at 15 blocks each grow to 34 in 70 blocks: some are preempted and
    recomputed (a recomputed sequence longer than the cache's room for one chunk is computed in
    smaller chunks); same tokens."""
    ps = [list(range(600 + 20 * i, 620 + 20 * i)) for i in range(4)]
    params = GREEDY.replace(max_tokens=60)
    expected = generate(make(sliding_window_kv=False), ps, params)
    engine = make(num_kv_blocks=70)
    assert generate(engine, ps, params) == expected
    assert engine.scheduler.num_preemptions > 0


def test_prefix_hits_bring_the_window(make):
    """A second prompt sharing a 50-token prefix (longer than the window) hits it: the global group
    its every block, the local groups the blocks its window sees; same tokens as without hits."""
    ps = prompts()
    expected = generate(make(sliding_window_kv=False, enable_prefix_caching=False), ps)
    engine = make()
    first = generate(engine, ps[:2])
    assert first == {k: expected[k] for k in ("r0", "r1")}
    request = engine.make_request("again", ps[2], GREEDY)
    hits = engine.kv.get_computed_blocks(request)
    assert len(hits) == 50 // BS
    null = engine.kv.null_block
    window_first = max(0, len(hits) * BS - WINDOW + 1) // BS
    assert all(hit[0] is not null for hit in hits)
    assert all((hit[g] is null) == (i < window_first) for i, hit in enumerate(hits) for g in (1, 2))
    engine.add_request("again", ps[2], GREEDY)
    assert run_to_completion(engine)["again"] == expected["r2"]
    assert engine.scheduler.prefix_hits >= 50 // BS * BS


def test_speculative_decoding_with_layer_groups(make):
    """Verification steps are chunks of k + 1 tokens: the local groups free behind them as well."""
    ps = [p * 2 for p in prompts()[:2]]
    expected = generate(make(sliding_window_kv=False), ps)
    engine = make(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert generate(engine, ps) == expected


def test_disaggregated_transfer_ships_only_the_kept_blocks(make):
    """Prefill and decode engines with layer groups: a local layer is sent the blocks from the
    window of the position after the prompt on, a global layer every block; the tokens equal
    colocated serving."""
    ps = prompts()
    expected = generate(make(), ps)
    assert disaggregated(make(max_num_batched_tokens=16), make(), ps, GREEDY) == expected

    prefill, decode = make(), make()
    prompt = ps[0]  # 70 tokens: blocks 0..17; the local layers' window starts in block (70 - 23) // 4
    hub, receiver = LocalHub(), KVReceiver(decode.runner.kv_cache, layout_of(decode), decode.kv_groups)
    hub.register("local://decode", receiver)
    request = decode.make_request("x", prompt, GREEDY)
    assert decode.reserve_remote_request(request) is not None
    tables = decode.kv.group_block_ids("x")
    null = decode.kv.null_block.block_id
    first = (len(prompt) - WINDOW + 1) // BS
    assert all(table[:first] == [null] * first for table in tables[1:])  # no block reserved before it
    receiver.expect("x", decode.kv.block_ids("x"), 0, len(prompt), 30.0, group_block_ids=tables)
    session = LocalSender(hub).open(SimpleNamespace(kv_address="local://decode", handle="x"),
                                    layout_of(prefill), len(prompt))
    sent = []
    inner_send = session.send_layer
    session.send_layer = lambda layer, first_block, k, v: (sent.append((layer, first_block, k.shape[0])),
                                                           inner_send(layer, first_block, k, v))
    exporter = KVExporter(prefill.runner, prefill.block_size, prefill.model_config.num_layers)
    exporter.add("x", Export(session, 0, len(prompt)))
    prefill.add_request("x", prompt, GREEDY.replace(max_tokens=1))
    firsts = run_to_completion(prefill)
    exporter.close()
    assert session.done.result(timeout=5) == (True, None)
    assert receiver.get("x").state is TransferState.DONE
    blocks = cdiv(len(prompt), BS)
    by_layer = {layer: (f, n) for layer, f, n in sent}
    assert by_layer == {0: (first, blocks - first), 1: (first, blocks - first), 2: (0, blocks)}
    receiver.release("x")
    decode.finish_remote_kv("x", True, firsts["x"])
    assert firsts["x"] + run_to_completion(decode)["x"] == expected["r0"]


def test_both_sides_must_keep_the_same_blocks(make):
    """A receiver that keeps every block and a sender that keeps only the window disagree on what
    travels: the handshake refuses it, naming the field."""
    problem = layout_of(make(sliding_window_kv=False)).mismatch(layout_of(make()))
    assert problem is not None and "layer_windows" in problem


def test_kv_bytes_stop_growing_for_the_local_layers(make):
    """Blocks held by one sequence: the local groups level off at the window, the global grows."""
    engine = make(max_num_batched_tokens=32)
    engine.add_request("long", list(range(500, 700)), GREEDY.replace(max_tokens=5))
    held = []
    while engine.has_unfinished():
        engine.step()
        if "long" in engine.scheduler.requests:
            held.append(engine.kv.num_blocks_held("long"))
    plain = 3 * cdiv(205, BS)  # every layer, every block
    assert max(held) < plain / 2
