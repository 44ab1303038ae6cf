"""pdserve sim: the real scheduler, router and autoscaling policies on simulated time."""

from __future__ import annotations

import dataclasses
import gc
import json
import random

import pytest

from pdserve.bench.config import BenchConfig
from pdserve.bench.latency_model import Profile, StepFeatures, StepModel, TransferModel, chunk_pairs
from pdserve.bench.metrics import SLO, RequestRecord, Summary
from pdserve.bench.sim import SimConfig, SimRequest, _Simulation, simulate
from pdserve.cluster.autoscale import AutoscalingConfig
from pdserve.cluster.cli import main
from pdserve.cluster.config import load_serve_config
from pdserve.configs import ConfigError

# Round numbers: a step is 10 ms + 0.1 ms per prompt token + 1 ms per decoding sequence; a transfer
# 5 ms + 10 us per token (1,000 bytes a token at 1e-8 s a byte).
STEP = StepModel(overhead_s=0.01, per_prefill_token_s=1e-4, per_attention_pair_s=0.0, per_decode_seq_s=1e-3,
                 per_decode_context_s=0.0)
PROFILE = Profile("measured", {"name": "test", "kv_bytes_per_token": 1000}, {"name": "test"}, STEP,
                  {"grpc": TransferModel(0.005, 1e-8)})
DECODE_STEP = 0.011  # one sequence


def prefill_s(tokens: int) -> float:
    return STEP.step_s(StepFeatures(tokens, chunk_pairs(0, tokens)))


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def random_requests(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(i, i / rate, ids(rng, rng.randint(32, 600)), rng.randint(4, 48)) for i in range(n)]


def run_checked(config: SimConfig, requests: list[SimRequest]):
    """Simulate, then check that every block went back to its pool (the scheduler tests' leak check)."""
    sim = _Simulation(config, PROFILE, requests)
    result = sim.run()
    for replica in sim.replicas:
        assert replica.kv.pool.num_referenced() == 0, replica.worker_id
        assert not replica.scheduler.requests
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    return result


def test_the_profiles_request_overhead_delays_each_request_and_not_its_gaps():
    """A request enters the cluster the profile's request overhead after it was sent: its first token and its
    end come that much later, its gaps between tokens do not."""
    requests = [SimRequest(0, 0.0, list(range(100, 300)), 5), SimRequest(1, 2.0, list(range(400, 500)), 3)]
    plain = simulate(SimConfig(), PROFILE, requests).records
    late = simulate(SimConfig(), dataclasses.replace(PROFILE, request_overhead_s=0.025), requests).records
    for a, b in zip(plain, late, strict=True):
        assert b.start == a.start and b.ttft == pytest.approx(a.ttft + 0.025)
        assert b.latency == pytest.approx(a.latency + 0.025) and b.itl == pytest.approx(a.itl)
    data = dataclasses.replace(PROFILE, request_overhead_s=0.025).to_json()
    assert Profile.from_json(data).request_overhead_s == 0.025
    del data["request_overhead_s"]  # a profile written before it was measured: none
    assert Profile.from_json(data).request_overhead_s == 0.0
    with pytest.raises(ValueError, match="request_overhead_s: must not be negative, got -1"):
        dataclasses.replace(PROFILE, request_overhead_s=-1.0)


def test_one_request_on_one_replica_takes_the_profiles_step_times():
    result = run_checked(SimConfig(), [SimRequest(0, 0.0, list(range(100, 300)), 5)])
    r = result.records[0]
    assert r.ttft == pytest.approx(prefill_s(200))  # 10 ms + 200 x 0.1 ms
    assert r.itl == pytest.approx([DECODE_STEP] * 4)
    assert r.tpot == pytest.approx(DECODE_STEP)
    assert r.output_tokens == 5 and result.duration_s == pytest.approx(prefill_s(200) + 4 * DECODE_STEP)


def test_a_prompt_share_prefills_a_burst_one_prompt_after_the_other():
    """Three 200-token prompts arriving while a fourth is prefilled: in one step after it without a prompt
    share (each first token when the last prompt's is), one after the other with ``max_prefill_tokens``
    200 (the engine's scheduler): the first one's first token sooner by the other two's prompts."""
    rng = random.Random(7)
    requests = [SimRequest(0, 0.0, ids(rng, 200), 50)] + [SimRequest(i, 0.001, ids(rng, 200), 2) for i in (1, 2, 3)]

    def burst_ttfts(config: SimConfig) -> list[float]:
        return sorted(r.ttft for r in run_checked(config, requests).records if r.index)

    together = burst_ttfts(SimConfig())
    assert together == pytest.approx([together[0]] * 3)
    apart = burst_ttfts(SimConfig(max_prefill_tokens=200))
    assert apart[0] < apart[1] < apart[2]
    assert together[0] - apart[0] == pytest.approx(prefill_s(600) - prefill_s(200), rel=0.05)
    assert sum(apart) < sum(together)  # the last one waits the longer for it: a step's overhead twice more
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        SimConfig(max_prefill_tokens=0)


def test_the_same_seed_gives_the_same_records_and_another_differs():
    config = SimConfig(prefill_replicas=2, decode_replicas=3)
    first = simulate(config, PROFILE, random_requests(150, 40.0, seed=1))
    again = simulate(config, PROFILE, random_requests(150, 40.0, seed=1))
    other = simulate(config, PROFILE, random_requests(150, 40.0, seed=2))
    assert [r.to_dict() for r in first.records] == [r.to_dict() for r in again.records]
    assert first.decisions == again.decisions and first.pools == again.pools
    assert [r.to_dict() for r in first.records] != [r.to_dict() for r in other.records]


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded", "round_robin", "random"])
def test_a_small_cluster_serves_every_request(policy):
    result = run_checked(SimConfig(prefill_replicas=2, decode_replicas=4, policy=policy, num_kv_blocks=512),
                         random_requests(300, 100.0, seed=3))
    assert sum(s.steps for s in result.replicas) > 0
    assert {"remote", "local_short"} <= set(result.decisions)


def test_a_long_prompt_is_prefilled_remotely_and_its_kv_shipped_before_decoding():
    rng = random.Random(4)
    result = run_checked(SimConfig(prefill_replicas=1, decode_replicas=1), [SimRequest(0, 0.0, ids(rng, 512), 3)])
    assert result.decisions == {"remote": 1}
    r = result.records[0]
    # The first token is the prefill worker's (the router streams it at once: the TTFT); the decode
    # worker's first step waits for the KV of the 512 tokens it does not hold.
    assert r.ttft == pytest.approx(prefill_s(512))
    assert r.itl == pytest.approx([PROFILE.transfer_s(512) + DECODE_STEP, DECODE_STEP])
    prefill, decode = sorted(result.replicas, key=lambda s: s.role, reverse=True)
    assert (prefill.role, prefill.steps, decode.steps) == ("prefill", 1, 2)


def test_a_prefill_workers_step_pays_for_shipping_the_kv_it_computes():
    """A profile that measured what shipping KV adds to a step (TransferModel.export_step_*): a prefill
    worker's step takes that much longer for the tokens it ships; a colocated prefill, nothing more."""
    rng = random.Random(4)
    shipping = dataclasses.replace(PROFILE, transfer={"grpc": TransferModel(0.005, 1e-8, 0.002, 1e-7)})
    extra = 0.002 + 1e-7 * 512 * 1000  # 53.2 ms for 512 tokens of 1,000 bytes
    assert shipping.export_step_s(512) == pytest.approx(extra) and shipping.export_step_s(0) == 0
    request = [SimRequest(0, 0.0, ids(rng, 512), 3)]
    result = simulate(SimConfig(prefill_replicas=1, decode_replicas=1), shipping, request)
    assert result.decisions == {"remote": 1}
    assert result.records[0].ttft == pytest.approx(prefill_s(512) + extra)
    prefill = next(s for s in result.replicas if s.role == "prefill")
    assert prefill.busy_s == pytest.approx(prefill_s(512) + extra)
    colocated = simulate(SimConfig(), shipping, request)
    assert colocated.records[0].ttft == pytest.approx(prefill_s(512))
    # The second prompt shares 256 tokens with the first, which the prefill worker holds: it computes the
    # other 1,024. To the decode worker that held the first it ships those; to another (taking turns), all.
    prefix = ids(rng, 256)
    requests = [SimRequest(0, 0.0, prefix + ids(rng, 1024), 2), SimRequest(1, 5.0, prefix + ids(rng, 1024), 2)]
    for decode_replicas, shipped in ((1, 1024), (2, 1280)):
        config = SimConfig(prefill_replicas=1, decode_replicas=decode_replicas, policy="round_robin")
        result = simulate(config, shipping, requests)
        assert result.decisions == {"remote": 2} and result.records[1].cached_tokens == 256
        assert result.records[1].ttft == pytest.approx(prefill_s(1024) + 0.002 + 1e-7 * shipped * 1000)


def test_a_short_prompt_is_prefilled_where_it_is_decoded():
    rng = random.Random(5)
    result = run_checked(SimConfig(prefill_replicas=1, decode_replicas=1), [SimRequest(0, 0.0, ids(rng, 64), 3)])
    assert result.decisions == {"local_short": 1}  # under disagg_min_prompt_tokens (128)
    assert result.records[0].ttft == pytest.approx(prefill_s(64))
    assert [s.steps for s in result.replicas if s.role == "prefill"] == [0]


def test_a_repeated_prefix_hits_the_cache_and_its_first_token_comes_sooner():
    rng = random.Random(6)
    prefix = ids(rng, 256)
    requests = [SimRequest(0, 0.0, prefix + ids(rng, 16), 2), SimRequest(1, 1.0, prefix + ids(rng, 16), 2)]
    result = run_checked(SimConfig(), requests)
    first, second = result.records
    assert first.ttft == pytest.approx(prefill_s(272))
    assert second.ttft == pytest.approx(prefill_s(16))  # the prefix's 16 blocks were cached
    assert result.replicas[0].prefix_hits == 256
    assert [r.cached_tokens for r in result.records] == [0, 256]  # as the server's usage reports them
    assert result.summary().prefix_hit_rate == pytest.approx(256 / 544)


def test_a_remote_prefill_reports_the_prefill_workers_cached_tokens():
    rng = random.Random(8)
    prefix = ids(rng, 1024)
    requests = [SimRequest(0, 0.0, prefix + ids(rng, 512), 2), SimRequest(1, 5.0, prefix + ids(rng, 512), 2)]
    # Taking turns, the second goes to the decode worker without the prefix, so it is prefilled remotely
    # again, where the prefill worker holds the prefix from the first.
    config = SimConfig(prefill_replicas=1, decode_replicas=2, policy="round_robin")
    result = run_checked(config, requests)
    assert result.decisions == {"remote": 2}
    assert [r.cached_tokens for r in result.records] == [0, 1024]


def prefix_hits(policy: str) -> int:
    rng = random.Random(7)
    prefixes = [ids(rng, 512), ids(rng, 512)]
    requests = [SimRequest(i, 0.5 * i, prefixes[i % 2] + ids(rng, 8), 4) for i in range(16)]
    result = run_checked(SimConfig(decode_replicas=4, policy=policy), requests)
    return sum(s.prefix_hits for s in result.replicas)


def test_cache_aware_routing_sends_repeats_to_the_worker_holding_their_prefix():
    # Every repeat of each prefix after its first goes where that prefix is (the index, fed by the
    # replicas' KV events); taking turns misses on every worker that has not seen it yet.
    assert prefix_hits("cache_aware") == 14 * 512
    assert prefix_hits("round_robin") < 14 * 512


def test_the_autoscaler_adds_a_replica_after_its_window_and_it_serves_after_start_up():
    scaling = AutoscalingConfig(min_replicas=1, max_replicas=3, target_running_requests=4, upscale_window_s=5.0,
                                downscale_window_s=60.0)
    rng = random.Random(8)
    requests = [SimRequest(i, 0.1 * i, ids(rng, 64), 400) for i in range(200)]  # a step of 10 req/s from t=0
    result = run_checked(SimConfig(decode_replicas=1, autoscaling={"decode": scaling}, startup_s=10.0), requests)
    timeline = result.pools["decode"]
    asked_at = next(t for t, _, asked in timeline if asked >= 2)
    ready_at = next(t for t, ready, _ in timeline if ready >= 2)
    assert asked_at >= scaling.upscale_window_s
    assert ready_at == pytest.approx(asked_at + 10.0)
    added = [s for s in result.replicas if s.worker_id == "decode-1"][0]
    assert added.ready == pytest.approx(ready_at) and added.steps > 0
    assert max(asked for _, _, asked in timeline) <= 3


def test_a_look_back_averages_what_the_autoscaler_sees_and_delays_a_step_by_less_than_itself():
    """Serve hands the policy each replica's numbers averaged over its look-back (SimConfig.look_back_s,
    from the cluster's metrics interval): a step of load is seen later, by less than the look-back plus
    a decision interval, and the replica still comes."""
    scaling = AutoscalingConfig(min_replicas=1, max_replicas=2, target_running_requests=2, upscale_window_s=2.0,
                                downscale_window_s=60.0)
    rng = random.Random(12)
    requests = [SimRequest(i, 0.25 * i, ids(rng, 64), 200) for i in range(60)]
    config = SimConfig(decode_replicas=1, autoscaling={"decode": scaling}, startup_s=3.0, autoscale_interval_s=0.5)

    def asked_at(c: SimConfig) -> float:
        return next(t for t, _, asked in run_checked(c, requests).pools["decode"] if asked == 2)

    now, looked_back = asked_at(config), asked_at(dataclasses.replace(config, look_back_s=1.0))
    assert now < looked_back <= now + 1.0 + config.autoscale_interval_s
    serve = load_serve_config(None, {"ray": {"metrics_interval_s": 0.25}})
    assert SimConfig.from_serve(serve, PROFILE).look_back_s == 0.5  # what cluster/ray_app.py asks of Serve


def test_after_the_load_the_pool_scales_back_down_within_settle_s():
    scaling = AutoscalingConfig(min_replicas=1, max_replicas=2, target_running_requests=2, upscale_window_s=2.0,
                                downscale_window_s=10.0)
    rng = random.Random(9)
    requests = [SimRequest(i, 0.1 * i, ids(rng, 64), 100) for i in range(100)]  # 10 s at 10 req/s
    config = SimConfig(decode_replicas=1, autoscaling={"decode": scaling}, startup_s=3.0)
    timeline = run_checked(config, requests).pools["decode"]
    assert max(asked for _, _, asked in timeline) == 2 and timeline[-1][2] == 2  # no decision once the load ended
    result = run_checked(dataclasses.replace(config, settle_s=30.0), requests)
    timeline = result.pools["decode"]
    up = next(t for t, _, asked in timeline if asked == 2)
    down = next(t for t, _, asked in timeline if t > up and asked == 1)
    last = max(r.start + r.latency for r in result.records)
    assert last + scaling.downscale_window_s <= down <= last + 30.0  # a whole window of low load first
    assert timeline[-1][1:] == (1, 1)


def test_the_cli_writes_the_bench_json_and_plots(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("pools:\n  prefill: {replicas: 1}\n  decode: {replicas: 2}\nrouter: {policy: least_loaded}\n")
    rc = main(["sim", "--config", str(cluster), "--roofline", "h100-sxm", "--shape", "smollm2-135m",
               "--num-prompts", "30", "--request-rate", "10", "--random-input-len", "300", "--random-output-len", "8",
               "--goodput", "ttft:500", "tpot:50", "--result-dir", str(tmp_path / "out"), "--label", "run"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "requests per wall second" in printed and "Successful requests:" in printed
    data = json.loads((tmp_path / "out" / "run.json").read_text())
    assert {"config", "runs", "model", "goodput_rate", "interrupted", "slo"} <= set(data)  # pdserve bench's keys
    assert set(data["config"]) == {f.name for f in dataclasses.fields(BenchConfig)}
    run = data["runs"][0]
    assert set(run) == {"rate", "summary", "records"}
    assert set(run["summary"]) == {f.name for f in dataclasses.fields(Summary)}
    assert set(run["records"][0]) == set(RequestRecord(0, 0.0, 1, 1).to_dict())
    assert run["summary"]["completed"] == 30 and data["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert data["sim"]["config"]["prefill_replicas"] == 1 and data["sim"]["config"]["policy"] == "least_loaded"
    for name in ("run-latency.png", "run-timeline.png", "run-replicas.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


@pytest.mark.parametrize(("args", "named"), [
    (["--dataset-name", "chat"], "--dataset-name"),
    (["--profile", "/nonexistent.json"], "--profile"),
    (["--transfer-backend", "carrier-pigeon"], "--transfer-backend"),
])
def test_the_cli_names_the_flag_it_refuses(args, named, capsys):
    assert main(["sim", "--num-prompts", "2", *args]) == 2
    assert named in capsys.readouterr().err


def test_the_cli_names_the_config_key_it_refuses(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("pools:\n  decode: {replics: 2}\n")
    assert main(["sim", "--config", str(cluster), "--num-prompts", "2"]) == 2
    assert "replics" in capsys.readouterr().err


def mixed_requests(n: int, rate: float, seed: int) -> list[SimRequest]:
    """Random prompts, a quarter of them on one of two shared 256-token prefixes (prefix hits)."""
    rng = random.Random(seed)
    shared = [ids(rng, 256), ids(rng, 256)]
    return [SimRequest(i, i / rate, (shared[i % 2] if i % 4 < 2 else []) + ids(rng, rng.randint(8, 400)),
                       rng.randint(2, 60)) for i in range(n)]


@pytest.mark.parametrize("pools", [(0, 3), (2, 3)], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_fast_decode_steps_give_what_the_schedulers_steps_give(pools, policy, block_size):
    """Decode-only steps skipped past the scheduler, in runs of one event that the router's polls
    and arrivals break into: every record, replica count and decision as the scheduler's steps give."""
    # Few blocks and seats: preemptions, full batches with a queue, evictions of cached prefixes.
    config = SimConfig(prefill_replicas=pools[0], decode_replicas=pools[1], policy=policy, num_kv_blocks=140 * 16 //
                       block_size, max_num_seqs=8, block_size=block_size, poll_interval_s=0.03)
    requests = mixed_requests(200, 60.0, seed=9)
    fast = run_checked(config, requests)
    reference = run_checked(dataclasses.replace(config, fast_decode=False), requests)
    assert [r.to_dict() for r in fast.records] == [r.to_dict() for r in reference.records]
    assert fast.replicas == reference.replicas
    assert fast.decisions == reference.decisions and fast.pools == reference.pools
    assert sum(s.prefix_hits for s in fast.replicas) > 0 and sum(s.preemptions for s in fast.replicas) > 0
    assert fast.events < reference.events  # decode-only steps in a row went as one event (runs)


def test_a_step_that_preempts_all_it_ran_is_scheduled_again():
    """A lone running request that needs a block nobody frees preempts itself, and the scheduler's call
    admits nothing; the engine's loop schedules again at once (the queue's head, with the blocks of
    landed remote KV behind it given back). The simulation did not, and its replicas stopped."""
    config = SimConfig(prefill_replicas=2, decode_replicas=3, policy="least_loaded", num_kv_blocks=160,
                       max_num_seqs=8)
    result = run_checked(config, mixed_requests(200, 70.0, seed=10))
    assert sum(s.preemptions for s in result.replicas) > 0


def test_compact_records_give_the_summary_of_full_records():
    config = SimConfig(prefill_replicas=1, decode_replicas=3, num_kv_blocks=512)
    requests = mixed_requests(150, 40.0, seed=10)
    full = simulate(config, PROFILE, requests)
    compact = simulate(dataclasses.replace(config, compact_records=True), PROFILE, requests)
    assert all(r.itl == () for r in compact.records)
    slo = SLO(ttft_ms=200, tpot_ms=20)
    expected, got = full.summary(slo).to_dict(), compact.summary(slo).to_dict()
    assert got.pop("itl_ms") == pytest.approx(expected.pop("itl_ms"), rel=1e-12)
    assert got == expected


@pytest.mark.parametrize("dataset", ["random", "prefix"])
def test_the_simulated_requests_are_the_ones_the_bench_sends(dataset):
    """The runner's own workload at its own arrival times (a gamma process when bursty, as the
    runner reads vLLM's flags), its warm-up requests first and left out of the summary."""
    from pdserve.bench.runner import arrival_offsets, build_workload
    from pdserve.bench.sim_cli import requests_from_bench
    from pdserve.engine.tokenizer import load_tokenizer

    config = BenchConfig(dataset_name=dataset, num_prompts=12, warmup_requests=2, random_input_len=300,
                         random_range_ratio=0.5, burstiness=0.5, seed=7, prefix_len=64, suffix_len=32)
    tokenizer = load_tokenizer(config.tokenizer)
    requests = requests_from_bench(config, 3.0, tokenizer)
    items = build_workload(config, tokenizer)
    assert [r.prompt for r in requests] == [i.prompt for i in items] and len(requests) == 14
    assert [r.arrival for r in requests] == arrival_offsets(14, 3.0, "gamma", 0.5, 7)
    assert [r.warmup for r in requests] == [True, True] + [False] * 12
    result = simulate(SimConfig(decode_replicas=2), PROFILE, requests)
    assert sum(not r.warmup for r in result.records) == 12 and result.summary(None).completed == 12


@pytest.mark.parametrize("compact", [False, True], ids=["heap", "heap-rebuilt"])
@pytest.mark.parametrize("pools", [(0, 4), (2, 3)], ids=["colocated", "disaggregated"])
def test_indexed_picks_choose_what_the_policy_chooses_over_every_load(pools, compact, monkeypatch):
    """least_loaded and least_queued_prefill pick from an index kept by their key (_PickIndex):
    the records, decisions and replicas equal a run whose picks scan every worker's load, with
    preemptions, retried reservations (few blocks) and an autoscaled pool changing the rotation.
    ``compact``: the index's heap rebuilt from its current entries whenever it holds an old one."""
    if compact:
        monkeypatch.setattr("pdserve.bench.sim.PICK_HEAP_SLACK", 1)
        monkeypatch.setattr("pdserve.bench.sim.PICK_HEAP_MIN", 0)
    config = SimConfig(prefill_replicas=pools[0], decode_replicas=pools[1], policy="least_loaded",
                       num_kv_blocks=160, max_num_seqs=8, poll_interval_s=0.05,
                       autoscaling={"decode": AutoscalingConfig(min_replicas=pools[1], max_replicas=pools[1] + 2,
                                                                target_running_requests=3, upscale_window_s=0.5,
                                                                downscale_window_s=1.0)})
    requests = mixed_requests(300, 80.0, seed=11)
    indexed = run_checked(config, requests)
    monkeypatch.setattr("pdserve.bench.sim.POLICY_KEYS", {})
    scanned = run_checked(config, requests)
    assert [r.to_dict() for r in indexed.records] == [r.to_dict() for r in scanned.records]
    assert indexed.replicas == scanned.replicas and indexed.events == scanned.events
    assert indexed.decisions == scanned.decisions and indexed.pools == scanned.pools
    assert len(indexed.replicas) > sum(pools)  # the autoscaler added replicas: the rotation changed


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
def test_a_simulation_makes_no_cyclic_garbage(policy):
    """simulate() runs with the cyclic collector off, so every object a request makes must be freed by
    reference counting: with the collector off, a run (disaggregated and colocated requests,
    preemptions, prefix hits, an autoscaled pool, compact records) leaves nothing for it to find."""
    config = SimConfig(prefill_replicas=2, decode_replicas=3, policy=policy, num_kv_blocks=160, max_num_seqs=8,
                       poll_interval_s=0.05, compact_records=True,
                       autoscaling={"decode": AutoscalingConfig(min_replicas=3, max_replicas=5,
                                                                target_running_requests=3, upscale_window_s=0.5,
                                                                downscale_window_s=1.0)})
    simulate(config, PROFILE, mixed_requests(20, 80.0, seed=12))  # what a first run does once (lazy imports)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        sim = _Simulation(config, PROFILE, mixed_requests(300, 80.0, seed=12))
        result = sim.run()
        found = gc.collect()  # the simulation still held: only garbage its requests left is unreachable
        sim.close()
        del sim
        left = gc.collect()  # closed and dropped: reference counting freed all of it
    finally:
        if enabled:
            gc.enable()
    assert sum(s.preemptions for s in result.replicas) > 0 and sum(s.prefix_hits for s in result.replicas) > 0
    assert len(result.replicas) > 5 and {"remote", "local_short"} <= set(result.decisions)
    assert found == 0 and left == 0
    assert gc.isenabled() == enabled


def test_a_worker_shows_what_its_servicer_would_its_rate_from_ended_steps_and_reservations_as_waiting():
    """The router's view of a simulated worker is the live worker's (worker/servicer.py, engine stats): a
    prompt step's rate is measured when the step ends, so a long prompt under way leaves the worker's
    rate unmeasured (the cost model's default, as on the cluster); requests whose blocks are reserved
    for remote KV count as waiting. Both changed routing decisions against a recorded run (sim_validate)."""
    from pdserve.bench.sim import _Replica
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams

    replica = _Replica("decode-0", "decode", SimConfig(decode_replicas=1), "test", 0.0)
    prompt = Request("0", list(range(100, 612)), SamplingParams(max_tokens=2, ignore_eos=True))
    replica.scheduler.add_request(prompt)
    out, seconds = replica.begin_step(PROFILE, None)
    under_way = replica.load(0.0, 0.0)
    assert under_way.num_running == 1 and under_way.prefill_tokens_per_s == 0.0
    replica.end_step(out, seconds)
    ended = replica.load(seconds, 0.0)
    assert ended.prefill_tokens_per_s == pytest.approx(512 / prefill_s(512))
    assert ended.num_waiting == 0
    reserved = Request("1", list(range(700, 1000)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert replica.scheduler.reserve_remote_kv(reserved) is not None
    assert replica.load(seconds, 0.0).num_waiting == 1


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
def test_the_decisions_debug_log_is_the_routers_and_changes_nothing(policy, caplog):
    """With ``pdserve --log-level DEBUG sim`` each decision is logged as the router's debug line (the same
    function writes both: router/cost.py ``describe_pick``, ``describe_prefill``), so a real run's router
    log and a simulation of its requests can be compared line by line; logging changes no result."""
    import logging

    config = SimConfig(prefill_replicas=1, decode_replicas=2, policy=policy)
    requests = random_requests(20, 5.0, seed=3)
    quiet = run_checked(config, requests)
    with caplog.at_level(logging.DEBUG, logger="pdserve.bench.sim"):
        logged = run_checked(config, requests)
    assert [r.to_dict() for r in logged.records] == [r.to_dict() for r in quiet.records]
    assert logged.decisions == quiet.decisions
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "pdserve.bench.sim"]
    picks = [line for line in lines if ": route decode: " in line]
    assert len(picks) >= len(requests)  # one decode pick each (a reservation refused picks again)
    assert all(line.startswith("t=") and " request " in line and " -> decode-" in line for line in picks)
    assert "(inflight " in picks[0] and " tok/s, step " in picks[0]
    prefills = [line for line in lines if ": prefill " in line]
    assert sum(" prefill remote " in line for line in prefills) == quiet.decisions.get("remote", 0)
