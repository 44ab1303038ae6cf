"""Disaggregation inside one process (the local backend): two engines, the real exporter and
receiver, outputs token-identical to colocated serving; transfer faults caught by the receiver."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.kvtransfer.base import KVLayout, TransferError, TransferState
from pdserve.kvtransfer.local import LocalHub, LocalSender
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.prefill_worker.export import Export, KVExporter
from tests.conftest import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def layout_of(engine) -> KVLayout:
    from pdserve.worker.servicer import engine_layout

    return engine_layout(engine)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    out = []
    for i in range(n):
        tail = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 50))]
        out.append((shared + tail) if i % 2 else tail + [7] * (i % 5))
    return out


def disaggregated(prefill, decode, ps, params=GREEDY, lease_s=30.0) -> dict[str, list[int]]:
    hub = LocalHub()
    receiver = KVReceiver(decode.runner.kv_cache, layout_of(decode), decode.kv_groups)
    hub.register("local://decode", receiver)
    exporter = KVExporter(prefill.runner, prefill.block_size, prefill.model_config.num_layers)
    sender = LocalSender(hub)
    sessions = {}
    for i, p in enumerate(ps):
        rid = f"r{i}"
        request = decode.make_request(rid, p, params)
        assert decode.reserve_remote_request(request) is not None
        skip = request.num_computed_tokens // decode.block_size
        receiver.expect(rid, decode.kv.block_ids(rid), skip, len(p), lease_s,
                        group_block_ids=decode.kv.group_block_ids(rid))
        sessions[rid] = sender.open(SimpleNamespace(kv_address="local://decode", handle=rid), layout_of(prefill),
                                    len(p))
        exporter.add(rid, Export(sessions[rid], skip, len(p)))
        prefill.add_request(rid, p, params.replace(max_tokens=1))
    firsts = run_to_completion(prefill)
    exporter.close()  # everything handed to the sessions
    for rid, session in sessions.items():
        ok, error = session.done.result(timeout=1)
        assert ok, error
        assert receiver.get(rid).state is TransferState.DONE
        receiver.release(rid)
        decode.finish_remote_kv(rid, True, firsts[rid])
    rest = run_to_completion(decode)
    return {rid: firsts[rid] + rest.get(rid, []) for rid in sessions}


def colocated(engine, ps, params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    return run_to_completion(engine)


def test_disaggregated_equals_colocated(make_engine):
    ps = prompts(32)  # as many concurrent requests as the multi-process tests
    expected = colocated(make_engine(), ps)
    decode = make_engine()
    colocated(decode, ps[:3])  # warm the decode worker's prefix cache: some blocks need not travel
    assert disaggregated(make_engine(max_num_batched_tokens=24), decode, ps) == expected


def test_seeded_sampling_continues_exactly(make_engine):
    ps = prompts(6, seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    expected = colocated(make_engine(), ps, params)
    assert disaggregated(make_engine(), make_engine(), ps, params) == expected


def test_handshake_refuses_a_different_layout(make_engine):
    decode = make_engine()
    receiver = KVReceiver(decode.runner.kv_cache, layout_of(decode))
    request = decode.make_request("x", list(range(100, 140)), GREEDY)
    receiver.expect("x", decode.reserve_remote_request(request), 0, 40, 5.0)
    other = KVLayout(layout_of(decode).model_fingerprint, "float32", 32, 2, 2, 16)
    with pytest.raises(TransferError) as e:
        receiver.begin("x", other, 40)
    assert e.value.reason == "layout_mismatch"
    assert "block_size: sender 32, receiver 16" in str(e.value)
    decode.abort_request("x")


def test_receiver_catches_bad_chunks(make_engine):
    decode = make_engine()
    layout = layout_of(decode)
    receiver = KVReceiver(decode.runner.kv_cache, layout)
    request = decode.make_request("x", list(range(100, 140)), GREEDY)  # 40 tokens: 3 blocks
    receiver.expect("x", decode.reserve_remote_request(request), 0, 40, 5.0)
    receiver.begin("x", layout, 40)
    per_block = layout.num_kv_heads * layout.block_size * layout.head_dim
    block = torch.zeros(1, per_block).numpy().tobytes()
    with pytest.raises(TransferError, match="checksum"):
        receiver.chunk("x", 0, 0, block, block, 12345)
    receiver.begin("x", layout, 40)  # a new sender may take over a failed transfer
    receiver.chunk("x", 0, 0, block, block, None)
    with pytest.raises(TransferError, match="incomplete"):
        receiver.commit("x")
    assert receiver.get("x").state is TransferState.FAILED
    decode.abort_request("x")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8"])
def test_quantized_kv_cache_travels_as_is(make_engine, kv_dtype):
    """bfloat16 and quantized blocks (their scales inside) cross unchanged: the same tokens as a
    colocated engine with the same cache, at half a float32 cache's bytes (bfloat16) or
    (head_dim + 4) / (4 * head_dim) of them."""
    ps = prompts(8, seed=2)
    expected = colocated(make_engine(kv_cache_dtype=kv_dtype), ps)
    decode = make_engine(kv_cache_dtype=kv_dtype)
    assert layout_of(decode).dtype == kv_dtype
    assert disaggregated(make_engine(kv_cache_dtype=kv_dtype), decode, ps) == expected
    hd = decode.model_config.head_dim
    float_row = make_engine().runner.kv_cache[0, 0, 0].numel() * 4
    row = decode.runner.kv_cache[0, 0, 0].numel() * decode.runner.kv_cache.element_size()
    assert row / float_row == (0.5 if kv_dtype == "bfloat16" else (hd + 4) / (4 * hd))


def test_float_and_quantized_workers_refuse_each_other(make_engine):
    decode = make_engine(kv_cache_dtype="int8")
    receiver = KVReceiver(decode.runner.kv_cache, layout_of(decode))
    request = decode.make_request("x", list(range(100, 140)), GREEDY)
    receiver.expect("x", decode.reserve_remote_request(request), 0, 40, 5.0)
    with pytest.raises(TransferError, match="dtype: sender 'float32', receiver 'int8'"):
        receiver.begin("x", layout_of(make_engine()), 40)
    decode.abort_request("x")


def test_the_lease_runs_from_the_first_chunk(make_engine):
    """A reservation waits ``wait_s`` for its transfer to begin (a queued prompt), then the
    lease bounds the transfer from its first chunk."""
    import time

    decode = make_engine()
    receiver = KVReceiver(decode.runner.kv_cache, layout_of(decode))
    request = decode.make_request("x", list(range(100, 140)), GREEDY)
    incoming = receiver.expect("x", decode.reserve_remote_request(request), 0, 40, lease_s=0.2, wait_s=30.0)
    assert incoming.deadline - time.monotonic() > 20
    assert receiver.expired(time.monotonic() + 1.0) == []
    receiver.begin("x", layout_of(decode), 40)
    assert incoming.deadline - time.monotonic() <= 0.2
    assert asyncio.run(receiver.wait("x")) == (False, "lease_expired")
    receiver.release("x")
    decode.abort_request("x")


def test_every_chunk_renews_the_lease(make_engine):
    """Chunks come as the prefill computes, so a transfer lasts as long as its prompt's prefill
    (a long prompt, a loaded machine): each chunk renews the lease; a commit leaves the blocks
    waiting for their request as long as a reservation waits for its transfer."""
    import time

    decode = make_engine()
    layout = layout_of(decode)
    receiver = KVReceiver(decode.runner.kv_cache, layout)
    request = decode.make_request("x", list(range(100, 140)), GREEDY)  # 3 blocks
    incoming = receiver.expect("x", decode.reserve_remote_request(request), 0, 40, lease_s=5.0, wait_s=60.0)
    receiver.begin("x", layout, 40)
    first_deadline = incoming.deadline
    per_block = decode.runner.kv_cache[0, 0, 0].numel()
    block = torch.zeros(3, per_block)
    for layer in range(layout.num_layers):
        while time.monotonic() <= first_deadline - 5.0 + 0.05 * (layer + 1):  # let time pass, however slowly
            time.sleep(0.01)
        before = time.monotonic()
        receiver.chunk("x", layer, 0, block, block, None)
        assert incoming.deadline >= before + 5.0
    assert receiver.expired(first_deadline + 0.01) == []  # past the first chunk's lease, still alive
    receiver.commit("x")
    assert incoming.deadline >= time.monotonic() + 50
    assert asyncio.run(receiver.wait("x")) == (True, None)
    receiver.release("x")
    decode.abort_request("x")
