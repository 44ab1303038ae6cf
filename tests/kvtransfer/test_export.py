"""The prefill side's exporter: each prefill step ships the blocks it completed (not only the step
that completes the prompt), every block exactly once with its final content, off the engine
thread; the receiver checks the header's token count; bfloat16 and float16 caches travel as
they are (bytes or tensors)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.kvtransfer.base import KVLayout, TransferError, TransferState, checksum, tensor_bytes
from pdserve.kvtransfer.local import LocalHub, LocalSender
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.prefill_worker.export import Export, KVExporter
from tests.conftest import run_to_completion
from tests.kvtransfer.test_local_backend import GREEDY, colocated, disaggregated, layout_of, prompts


class RecordingSession:
    """A local session that notes which thread fed it which blocks."""

    def __init__(self, inner):
        self.inner = inner
        self.done = inner.done
        self.calls: list[tuple[str, int, int, int]] = []  # (thread name, layer, first block, blocks)

    def send_layer(self, layer, first_block, keys, values):
        self.calls.append((threading.current_thread().name, layer, first_block, keys.shape[0]))
        self.inner.send_layer(layer, first_block, keys, values)

    def commit(self):
        self.inner.commit()

    def abort(self, reason):
        self.inner.abort(reason)


def open_transfer(prefill, decode, rid: str, prompt: list[int]):
    """A reservation on ``decode`` and a recording local session to it; (receiver, session, exporter)."""
    hub = LocalHub()
    receiver = KVReceiver(decode.runner.kv_cache, layout_of(decode), decode.kv_groups)
    hub.register("local://decode", receiver)
    request = decode.make_request(rid, prompt, GREEDY)
    assert decode.reserve_remote_request(request) is not None
    skip = request.num_computed_tokens // decode.block_size
    receiver.expect(rid, decode.kv.block_ids(rid), skip, len(prompt), 30.0,
                    group_block_ids=decode.kv.group_block_ids(rid))
    session = RecordingSession(LocalSender(hub).open(SimpleNamespace(kv_address="local://decode", handle=rid),
                                                     layout_of(prefill), len(prompt)))
    exporter = KVExporter(prefill.runner, prefill.block_size, prefill.model_config.num_layers)
    exporter.add(rid, Export(session, skip, len(prompt)))
    return receiver, session, exporter


def test_each_step_ships_the_blocks_it_completes(make_engine):
    """100 tokens in steps of 24 (blocks of 16): a block a step fills only partly goes with the
    step that completes it, the last (partial) block with the last step; nothing twice; every
    copy handed over off the engine thread."""
    prompt = list(range(1000, 1100))
    expected = colocated(make_engine(), [prompt])["r0"]
    prefill, decode = make_engine(max_num_batched_tokens=24), make_engine()
    receiver, session, exporter = open_transfer(prefill, decode, "r0", prompt)
    prefill.add_request("r0", prompt, GREEDY.replace(max_tokens=1))
    layers = prefill.model_config.num_layers
    first = None
    for computed, blocks in ((24, 1), (48, 3), (72, 4), (96, 6), (100, 7)):
        outs = prefill.step()
        assert exporter.flush()
        incoming = receiver.get("r0")
        assert [incoming.seen.get(layer, set()) for layer in range(layers)] == [set(range(blocks))] * layers, \
            f"after {computed} tokens"
        first = first or next((o.new_token_ids for o in outs if o.new_token_ids), None)
    assert not prefill.has_unfinished()
    exporter.close()
    assert session.done.result(timeout=5) == (True, None)
    assert receiver.get("r0").state is TransferState.DONE
    assert {name for name, *_ in session.calls} == {"kv-export"}  # never the engine's (this) thread
    per_layer0 = [(first_block, n) for _, layer, first_block, n in session.calls if layer == 0]
    assert per_layer0 == [(0, 1), (1, 2), (3, 1), (4, 2), (6, 1)]
    receiver.release("r0")
    decode.finish_remote_kv("r0", True, first)
    assert first + run_to_completion(decode)["r0"] == expected


def test_preempted_prefills_still_send_every_block_once(make_engine):
    """A prefill worker short of blocks (a colocated request decoding beside the prompts) preempts
    half-prefilled prompts and computes them again: blocks already sent are not sent twice (the
    receiver would refuse it), outputs unchanged."""
    ps = [p * 2 for p in prompts(8, seed=6)]  # up to 170 tokens
    expected = colocated(make_engine(), ps)
    prefill = make_engine(max_num_batched_tokens=40, num_kv_blocks=12)
    prefill.add_request("decoding", list(range(50, 66)), GREEDY.replace(max_tokens=80))
    assert disaggregated(prefill, make_engine(), ps) == expected
    assert prefill.scheduler.num_preemptions > 0


def test_a_prefix_hit_on_the_prefill_side_is_sent_with_the_first_step(make_engine):
    """Blocks the prefill worker had cached (not the decode worker) are computed by no step of
    this request; they go with its first one."""
    ps = prompts(6, seed=7)
    expected = colocated(make_engine(), ps)
    prefill = make_engine(max_num_batched_tokens=24)
    colocated(prefill, ps[1::2])  # the same prompts: their blocks cached on the prefill side only
    assert disaggregated(prefill, make_engine(), ps) == expected


def test_the_header_token_count_must_match_the_reservation(make_engine):
    decode = make_engine()
    layout = layout_of(decode)
    receiver = KVReceiver(decode.runner.kv_cache, layout)
    request = decode.make_request("x", list(range(100, 140)), GREEDY)
    receiver.expect("x", decode.reserve_remote_request(request), 0, 40, 5.0)
    with pytest.raises(TransferError, match="covers 41 tokens, the reservation 'x' holds 40") as e:
        receiver.begin("x", layout, 41)
    assert e.value.reason == "token_count"
    assert receiver.get("x").state is TransferState.FAILED
    decode.abort_request("x")


def test_a_chunk_that_is_not_whole_blocks_fails_the_transfer(make_engine):
    decode = make_engine()
    layout = layout_of(decode)
    receiver = KVReceiver(decode.runner.kv_cache, layout)
    request = decode.make_request("x", list(range(100, 140)), GREEDY)
    receiver.expect("x", decode.reserve_remote_request(request), 0, 40, 5.0)
    receiver.begin("x", layout, 40)
    with pytest.raises(TransferError, match="not the same whole number of blocks") as e:
        receiver.chunk("x", 0, 0, b"\0" * 10, b"\0" * 10, None)
    assert e.value.reason == "range"
    decode.abort_request("x")


@pytest.fixture(scope="module")
def half_models():
    from pdserve.engine.loader import load_model

    return {name: load_model("random:tiny", progress=False, seed=3, dtype=getattr(torch, name))
            for name in ("bfloat16", "float16")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_disaggregated_equals_colocated(make_engine, half_models, dtype):
    loaded = half_models[dtype]
    ps = prompts(8, seed=8)
    expected = colocated(make_engine(loaded, dtype=dtype), ps)
    decode = make_engine(loaded, dtype=dtype)
    assert layout_of(decode).dtype == dtype
    assert disaggregated(make_engine(loaded, dtype=dtype, max_num_batched_tokens=24), decode, ps) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bytes_of_any_dtype_land_exactly(dtype):
    """The grpc backend's path: blocks as bytes (numpy has no bfloat16), checksummed."""
    cache = torch.zeros(2, 2, 8, 3, 16 * 4, dtype=dtype)
    layout = KVLayout("m", str(dtype).removeprefix("torch."), 16, 2, 3, 4)
    receiver = KVReceiver(cache, layout)
    receiver.expect("x", [5, 2, 7], 1, 40, 5.0)
    receiver.begin("x", layout, 40)
    sent = torch.randn(2, 2, 2, 3, 16 * 4).to(dtype)  # [layer, k/v, blocks 1 and 2 of the request, ...]
    for layer in range(2):
        k, v = tensor_bytes(sent[layer, 0]), tensor_bytes(sent[layer, 1])
        receiver.chunk("x", layer, 1, bytes(k), bytes(v), checksum(k, v))
    receiver.commit("x")
    assert torch.equal(cache[:, :, [2, 7]], sent)
    assert not cache[:, :, 5].any()  # the block cached here already was not written


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_caches_export_and_import(make_engine, dtype):
    """On a GPU: the exporter indexes the CUDA cache with an index on its device, its copies wait
    for the snapshot on a stream of their own; the receiver writes with index_copy_ on the GPU."""
    from pdserve.engine.loader import load_model

    loaded = load_model("random:tiny", progress=False, seed=3, dtype=getattr(torch, dtype), device="cuda")
    loaded.model.rope.to("cuda")  # build_model leaves a random-weight model's rotary table on the CPU
    ps = prompts(8, seed=9)
    expected = colocated(make_engine(loaded, dtype=dtype, device="cuda"), ps)
    decode = make_engine(loaded, dtype=dtype, device="cuda")
    assert decode.runner.kv_cache.is_cuda
    prefill = make_engine(loaded, dtype=dtype, device="cuda", max_num_batched_tokens=24)
    assert disaggregated(prefill, decode, ps) == expected
