"""`pdserve profile`: the engine's step observer, the plan of steps, a quick measured profile of the
tiny model (written, loaded back, sensible, never timed tightly: the machine is shared), the roofline
profile from the command line, and bad input refused naming what is allowed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pdserve.bench.latency_model import Profile, StepFeatures, chunk_pairs, features_of
from pdserve.bench.profile import ProfileConfig, fit_transfer, measure_transfers, step_plan
from pdserve.cluster.cli import main
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_the_step_observer_sees_every_step_and_changes_nothing(make_engine):
    prompts = {"a": list(range(1000, 1040)), "b": list(range(2000, 2100))}
    plain, observed = make_engine(max_num_batched_tokens=64), make_engine(max_num_batched_tokens=64)
    assert plain.step_observer is None
    seen = []
    observed.step_observer = lambda sched, seconds: seen.append((features_of(sched.scheduled), seconds))
    for engine in (plain, observed):
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, GREEDY)
    assert run_to_completion(plain) == run_to_completion(observed)
    # 140 prompt tokens in chunks of at most 64, then the decodes: 6 tokens each, the first sampled
    # by the prefill's last chunk
    assert sum(f.prefill_tokens for f, _ in seen) == 140
    assert sum(f.decode_seqs for f, _ in seen) == 2 * 5
    assert all(s > 0 for _, s in seen)


def test_the_plan_covers_each_kind_of_step_early():
    waves = step_plan(2048, 8192)
    kinds = [w.kind for w in waves]
    assert kinds[:2] == ["warmup", "warmup"]
    assert set(kinds[2:6]) == {"prefill", "decode", "context", "mixed"}  # a run cut short still has each
    prefill = sorted(w.prompts[0] for w in waves if w.kind == "prefill")
    assert prefill[0] == 16 and prefill[-1] == 2048
    decode = [w for w in waves if w.kind == "decode"]
    assert {len(w.prompts) for w in decode} == {1, 4, 16, 64}
    assert {w.prompts[0] for w in decode} == {32, 256, 1024, 2048}
    assert all(w.prompts[0] > 2048 for w in waves if w.kind == "context")
    assert all(max(w.prompts + w.late) < 1000 for w in step_plan(2048, 1000))


def test_a_transfer_fit_recovers_its_line():
    points = [(n, 0.002 + 1e-9 * n) for n in (10_000, 1_000_000, 10_000_000) for _ in range(2)]
    t = fit_transfer(points)
    assert t.overhead_s == pytest.approx(0.002, rel=1e-6) and t.s_per_byte == pytest.approx(1e-9, rel=1e-6)
    assert fit_transfer([(1000, 0.001), (2000, 0.0005)]).s_per_byte == 0.0  # noise never makes a negative cost


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """One quick run of the command on the tiny model (its threads restored after)."""
    threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    out = tmp_path_factory.mktemp("profile")
    try:
        rc = main(["profile", "--quick", "-o", str(out / "p.json"), "--plot", str(out / "p.png")])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    assert os.sched_getaffinity(0) == cpus  # the export measurement's pinning undone
    return out


def test_a_quick_profile_is_written_and_predicts_sensibly(quick_profile):
    profile = Profile.load(quick_profile / "p.json")
    assert profile.kind == "measured"
    assert profile.model["name"] == "random:tiny" and profile.model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert profile.model["max_num_batched_tokens"] == 256
    assert profile.hardware["threads"] == 1 and "cpu_flags" in profile.hardware
    assert {"grpc", "local"} <= set(profile.transfer)
    fit = profile.fit
    assert fit["samples"] > 100 and fit["holdout_samples"] >= 20
    assert all(fit["by_shape"][k] > 5 for k in ("prefill", "decode", "mixed"))
    assert all(v >= 0 for v in dataclasses.asdict(profile.step).values())
    # Robust to a busy machine: more work is predicted to take longer, and shipping more bytes too.
    long, short = StepFeatures(2048, chunk_pairs(0, 2048)), StepFeatures(16, chunk_pairs(0, 16))
    assert profile.step_s(long) > profile.step_s(short)
    assert profile.step_s(StepFeatures(decode_seqs=64, decode_context=64 * 256)) > profile.step_s(
        StepFeatures(decode_seqs=1, decode_context=32))
    assert profile.transfer_s(4096, "grpc") >= profile.transfer_s(16, "grpc") > 0  # tiny payloads: noise may hide
    # What shipping KV adds to a step, measured against a KV sink in another process (a tiny model's step
    # barely notices: non-negative, and the note has the figures)
    grpc = profile.transfer["grpc"]
    assert grpc.export_step_overhead_s >= 0 and grpc.export_step_s_per_byte >= 0
    assert "a step shipping its KV to a sink in another process" in fit["transfer"]["grpc"]
    assert profile.transfer["local"].export_step_s_per_byte == 0
    assert (quick_profile / "p.png").stat().st_size > 1000


def test_the_roofline_command_writes_a_modelled_profile(tmp_path, capsys):
    path = tmp_path / "h100.json"
    assert main(["profile", "--roofline", "h100-sxm", "--shape", "llama-3-8b", "-o", str(path)]) == 0
    profile = Profile.load(path)
    assert profile.kind == "modelled" and profile.model["name"] == "llama-3-8b"
    assert profile.hardware["name"] == "NVIDIA H100 SXM" and "modelled" in profile.fit["note"]
    assert "modelled profile of llama-3-8b" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--roofline", "tpu-v9", "--shape", "llama-3-8b"], "unknown hardware 'tpu-v9'; one of ['h100-sxm', 'h200'"),
    (["--roofline", "h200", "--shape", "gpt-9"], "unknown preset 'gpt-9'; one of ['tiny', 'smollm2-135m'"),
    (["--roofline", "h200"], "--roofline needs --shape PRESET; one of ['tiny'"),
    (["--shape", "llama-3-8b"], "--shape is for a modelled profile: give --roofline HW too"),
    (["--transfer-backends", "grpc,pigeon"], "unknown ['pigeon']; known: ['grpc', 'local', 'torch']"),
])
def test_bad_input_is_refused_naming_what_is_allowed(argv, message, capsys):
    assert main(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_backend_that_cannot_run_here_is_noted_not_measured():
    assert ProfileConfig(transfer_backends="torch, ").backends == ["torch"]
    models, notes = measure_transfers(None, ["torch"], [64])
    assert models == {} and notes["torch"].startswith("not measured: needs two processes")


def test_the_kv_sink_answers_a_whole_push_and_refuses_a_corrupt_one():
    """The receiver `pdserve profile` ships to when it measures the sending side: another process, which
    checks each chunk's checksum and keeps nothing."""
    import asyncio

    import grpc

    from pdserve.bench.kv_sink import Sink
    from pdserve.kvtransfer.base import checksum
    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

    async def push(address: str, corrupt: bool) -> pb.PushKVResponse:
        keys, values = bytes(range(256)) * 64, bytes(reversed(range(256))) * 64
        chunk = pb.KVChunk(handle="h", layer=0, first_block=0, num_blocks=1, keys=keys, values=values,
                           checksum=checksum(keys, values) ^ corrupt)
        async with grpc.aio.insecure_channel(address) as channel:
            return await pb_grpc.WorkerStub(channel).PushKV(iter([chunk, pb.KVChunk(handle="h", commit=True)]))

    with Sink(avoid={0}) as address:
        assert asyncio.run(push(address, False)).ok
        answer = asyncio.run(push(address, True))
        assert not answer.ok and answer.error == "checksum: layer 0 block 0"
