"""Step traces: a serving worker's engine steps written as it runs, read back, and fitted into a profile."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest

from pdserve.bench.latency_model import Profile, StepFeatures, StepModel, TransferModel, chunk_pairs, features_of
from pdserve.bench.step_trace import (
    StepTraceWriter,
    profile_from_traces,
    read_trace,
    speed_against,
    trace_path,
)
from pdserve.cluster.cli import main
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from tests.worker.serving import generated

KNOWN = StepModel(0.004, 2e-4, 1e-8, 3e-4, 2e-7)
HEADER = {"role": "decode", "worker_id": "w", "model": {"name": "m", "kv_bytes_per_token": 64},
          "hardware": {"cpu": "x"}}


def scheduled(*items: tuple[int, int]):
    """A SchedulerOutput as the observer sees it: (start, num_tokens) per scheduled request."""
    return SimpleNamespace(scheduled=[SimpleNamespace(start=s, num_tokens=n) for s, n in items])


def write_known_trace(path, model: StepModel = KNOWN, scale: float = 1.0, header: dict = HEADER):
    """A trace of varied steps whose seconds are ``model``'s times ``scale``."""
    writer = StepTraceWriter(path, header)
    steps = [scheduled((0, n)) for n in (16, 64, 256, 1024, 2048)]
    steps += [scheduled(*[(c, 1)] * b) for b in (1, 4, 16, 64) for c in (32, 512, 2048)]
    steps += [scheduled((c, 1), (0, n)) for c in (64, 1024) for n in (128, 512)]
    steps += [scheduled((n, 256)) for n in (512, 2048)]
    for sched in steps * 3:
        writer.observe(sched, scale * model.step_s(features_of(sched.scheduled)))
    writer.close()
    return len(steps) * 3


def test_a_trace_reads_back_each_step_and_a_cut_last_line_is_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    writer = StepTraceWriter(path, HEADER)
    writer.observe(scheduled((0, 100), (40, 1)), 0.25)
    writer.observe(scheduled((40, 1), (41, 1)), 0.01)
    writer.close()
    writer.observe(scheduled((0, 5)), 1.0)  # after close: nothing more is written
    header, steps = read_trace(path)
    assert header["pdserve_step_trace"] == 1 and header["role"] == "decode" and header["model"]["name"] == "m"
    assert [(s, f) for _, s, f in steps] == [(0.25, StepFeatures(100, chunk_pairs(0, 100), 1, 41)),
                                             (0.01, StepFeatures(0, 0, 2, 83))]
    assert steps[0][0] <= steps[1][0]
    with open(path, "a") as f:
        f.write("[1.5, 0.02, 3")  # a worker killed mid-write
    assert len(read_trace(path)[1]) == 2


@pytest.mark.parametrize("text, message", [
    ('{"not": "a trace"}\n', "not a pdserve step trace"),
    ('{"pdserve_step_trace": 9}\n', "step trace version 9; this pdserve reads version 1"),
    ('{"pdserve_step_trace": 1}\n[1, 2, 3, 4, 5, 6]\n"x"\n[1, 2, 3, 4, 5, 6]\n', ":3: not a step row"),
])
def test_a_file_that_is_not_a_trace_is_refused_naming_why(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_trace(path)
    with pytest.raises(ValueError, match="No such file"):
        read_trace(tmp_path / "missing.jsonl")


def test_a_profile_fitted_to_traces_recovers_the_steps_model_and_keeps_the_transfers(tmp_path):
    n = write_known_trace(tmp_path / "a.jsonl") + write_known_trace(tmp_path / "b.jsonl")
    source = Profile("measured", {"name": "m", "kv_bytes_per_token": 64}, {}, KNOWN,
                     {"grpc": TransferModel(0.003, 1e-9)})
    profile, samples = profile_from_traces([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], source,
                                           transfer_source="p.json")
    assert len(samples) == n and profile.kind == "measured" and profile.fit["samples"] == n
    for name, value in dataclasses.asdict(KNOWN).items():
        assert getattr(profile.step, name) == pytest.approx(value, rel=1e-3), name  # seconds kept to the us
    assert profile.transfer == source.transfer and profile.fit["transfer"] == {"grpc": "from p.json"}
    assert profile.fit["source"]["roles"] == ["decode"] and profile.hardware == {"cpu": "x"}
    # the steps of a cluster 10% slower than the engine alone
    write_known_trace(tmp_path / "slow.jsonl", scale=1.1)
    assert speed_against(KNOWN, read_trace(tmp_path / "slow.jsonl")[1]) == pytest.approx(1.1)


def test_a_profile_fitted_to_traces_holds_what_shipping_kv_cost_in_its_steps_not_on_top(tmp_path):
    """A prefill worker's traced steps already took what shipping their KV added: the fitted profile's
    transfer models come without the export terms, so the simulator does not add them a second time."""
    source = Profile("measured", {"name": "m", "kv_bytes_per_token": 64}, {}, KNOWN,
                     {"grpc": TransferModel(0.003, 1e-9, 0.05, 2e-8)})
    write_known_trace(tmp_path / "p.jsonl", header={**HEADER, "role": "prefill"})
    profile, _ = profile_from_traces([tmp_path / "p.jsonl"], source)
    assert profile.transfer["grpc"] == TransferModel(0.003, 1e-9) and not profile.ships_with_cost("grpc")


def test_the_first_seconds_of_a_trace_can_be_left_out(tmp_path):
    write_known_trace(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="at least 5 samples, got 0"):
        profile_from_traces([tmp_path / "a.jsonl"], skip_s=3600)


def test_traces_of_two_models_are_not_fitted_together(tmp_path):
    write_known_trace(tmp_path / "a.jsonl")
    other = tmp_path / "b.jsonl"
    other.write_text(json.dumps({"pdserve_step_trace": 1, "model": {"name": "other", "kv_bytes_per_token": 1},
                                 "hardware": {}}) + "\n")
    with pytest.raises(ValueError, match=r"different models \(\['m', 'other'\]\)"):
        profile_from_traces([tmp_path / "a.jsonl", other])


def test_a_worker_started_with_step_trace_writes_every_step_and_the_rest_as_it_stops(tmp_path):
    """`pdserve worker decode --step-trace` (a real worker process): a header and every step it ran, the last
    ones written when it stops."""
    from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready

    template = str(tmp_path / "trace-{pid}.jsonl")
    worker = start_worker("decode", ["--port", "0", "--model", "random:tiny", "--no-load-progress", "--num-threads",
                                     "1", "--num-kv-blocks", "64", "--step-trace", template])
    try:
        wait_ready([worker], timeout_s=120)

        async def generate():
            async with grpc.aio.insecure_channel(worker.address) as channel:
                return await generated(pb_grpc.WorkerStub(channel), "r1", list(range(100, 140)))

        tokens = asyncio.run(generate())
    finally:
        stop_workers([worker], grace_s=10)
    header, steps = read_trace(trace_path(template, worker.pid))
    assert header["role"] == "decode" and header["pid"] == worker.pid and header["model"]["name"] == "random:tiny"
    assert header["model"]["kv_bytes_per_token"] > 0 and "cpu_flags" in header["hardware"]
    assert sum(f.prefill_tokens for _, _, f in steps) == 40
    assert sum(f.decode_seqs for _, _, f in steps) == len(tokens) - 1  # the prefill's step samples the first
    assert all(s > 0 for _, s, _ in steps)


def test_the_profile_command_fits_traces_and_refuses_what_does_not_go_together(tmp_path, capsys):
    write_known_trace(tmp_path / "a.jsonl")
    Profile("measured", {"name": "m", "kv_bytes_per_token": 64}, {}, KNOWN,
            {"grpc": TransferModel(0.003, 1e-9)}).save(tmp_path / "p.json")
    out = tmp_path / "fitted.json"
    assert main(["profile", "--from-trace", str(tmp_path / "a.jsonl"), "--trace-skip-s", "0", "--transfer-from",
                 str(tmp_path / "p.json"), "-o", str(out)]) == 0
    assert Profile.load(out).step.per_prefill_token_s == pytest.approx(KNOWN.per_prefill_token_s, rel=1e-3)
    assert "KV of 2048 tokens over grpc" in capsys.readouterr().out
    assert main(["profile", "--from-trace", "a.jsonl", "--roofline", "h200", "--shape", "tiny"]) == 2
    assert "one source of a profile at a time" in capsys.readouterr().err
    assert main(["profile", "--transfer-from", "p.json"]) == 2
    assert "--transfer-from goes with --from-trace" in capsys.readouterr().err
    assert main(["profile", "--from-trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_a_requests_time_outside_engine_steps_is_measured_through_a_server(tmp_path):
    """Against the timing-only mock server (first token at once): the overhead is the client's own and the
    loopback's, small and positive; a profile predicting a slower step than the TTFT measured gives 0."""
    from pdserve.bench.profile import measure_request_overhead, with_request_overhead
    from tests.bench.test_failures import completed, wait_for
    from tests.integration.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_server", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: completed(url) is not None, 60, "the mock server to answer")
        instant = Profile("measured", {"name": "m", "kv_bytes_per_token": 64}, {}, StepModel(0, 0, 0, 0, 0))
        profile = with_request_overhead(instant, url, samples=3)
        assert 0 < profile.request_overhead_s < 1.0
        assert profile.fit["request_overhead"]["requests"] == 3 and profile.step == instant.step
        assert measure_request_overhead(dataclasses.replace(instant, step=StepModel(10, 0, 0, 0, 0)), url, 2)[0] == 0
        write_known_trace(tmp_path / "a.jsonl")
        fitted, _ = profile_from_traces([tmp_path / "a.jsonl"], profile, transfer_source="p.json")
        assert fitted.request_overhead_s == profile.request_overhead_s  # carried with the transfers
    finally:
        proc.kill()
        proc.wait()
    assert main(["profile", "--serving-url", url, "--roofline", "h200", "--shape", "tiny"]) == 2
