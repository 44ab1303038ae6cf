"""pdserve plan: the search on a synthetic profile whose answer is known, the YAML it writes, its flags."""

from __future__ import annotations

import json
import random

import pytest
import yaml

from pdserve.bench.latency_model import Profile, StepModel, TransferModel
from pdserve.bench.metrics import SLO
from pdserve.bench.plan import Option, cluster_yaml, plan, write_yaml
from pdserve.bench.sim import SimConfig, SimRequest
from pdserve.cluster.cli import main
from pdserve.cluster.config import load_serve_config
from pdserve.configs import ConfigError

# Every step takes exactly STEP_S, whatever it computes. A request of 10 output tokens holds one of a
# replica's 4 sequence slots for 10 steps (its prefill and 9 decodes), so one colocated replica serves
# exactly 4 / (10 x 10 ms) = 40 req/s with no queueing. At 100 req/s (2.5x), arriving evenly and dealt
# round-robin: 3 replicas (120 req/s) keep TTFT at a step or two and meet a 50 ms TTFT SLO; 2 (80 req/s)
# fall further behind with every request.
STEP_S, SLOTS, OUTPUT, PROMPT, RATE = 0.010, 4, 10, 200, 100.0
SLO_ = SLO(ttft_ms=50, tpot_ms=25)
CONFIG = SimConfig(policy="round_robin", max_num_seqs=SLOTS, num_kv_blocks=4096)


def profile(step_s: float = STEP_S) -> Profile:
    return Profile("measured", {"name": "synthetic", "kv_bytes_per_token": 1000}, {"name": "synthetic"},
                   StepModel(step_s, 0.0, 0.0, 0.0, 0.0), {"grpc": TransferModel(0.001, 1e-9)})


def requests(n: int = 400) -> list[SimRequest]:
    rng = random.Random(0)
    return [SimRequest(i, i / RATE, [rng.randrange(100, 40000) for _ in range(PROMPT)], OUTPUT) for i in range(n)]


SLOW = Option("slow", profile(), 1.0, CONFIG)


@pytest.fixture(scope="module")
def one_option():
    return plan(requests(), SLO_, [SLOW])


def test_the_cheapest_is_the_known_answer_and_one_replica_fewer_misses(one_option):
    best = one_option.meeting[0]
    assert (best.option, best.prefill, best.decode, best.cost) == ("slow", 0, 3, 3.0)
    assert best.attainment == 1.0 and best.failed == 0
    two = next(c for c in one_option.candidates if (c.prefill, c.decode) == (0, 2))
    assert not two.meets and two.attainment < 0.5
    assert one_option.candidates[0] is best  # meeting first, by cost
    assert one_option.simulated_requests == one_option.total_requests == 400 and not one_option.notes


def test_disaggregated_configurations_are_searched(one_option):
    disaggregated = [c for c in one_option.meeting if c.prefill]
    assert disaggregated
    # Decode slots are still the limit (9 decode steps a request): 44 req/s a replica, so 3 decode replicas.
    assert min(disaggregated, key=lambda c: c.cost).mode == "1 prefill + 3 decode"
    assert all(c.cost > 3.0 for c in disaggregated)


@pytest.mark.parametrize("fast_cost, winner", [(1.4, "fast"), (1.6, "slow")])
def test_the_cheaper_option_wins_when_both_meet(fast_cost, winner):
    fast = Option("fast", profile(STEP_S / 2), fast_cost, CONFIG)  # twice the speed: 2 replicas suffice
    found = plan(requests(), SLO_, [SLOW, fast])
    assert {c.option for c in found.meeting} == {"slow", "fast"}
    assert found.meeting[0].option == winner
    assert min(c.decode for c in found.meeting if c.option == "fast" and not c.prefill) == 2


def test_a_large_workload_is_subsampled_and_said_so():
    found = plan(requests(), SLO_, [SLOW], max_requests=300, max_replicas=3)
    assert found.simulated_requests == 300 and found.total_requests == 400
    assert found.notes == ["simulated the first 300 of 400 requests (by arrival)"]


def test_the_written_yaml_validates_with_the_plans_pools_and_autoscaling(one_option, tmp_path):
    best = one_option.meeting[0]
    path = write_yaml(best, SLOW, SLO_, tmp_path / "cluster.yaml", {"engine": {"max_num_seqs": SLOTS}},
                      header="from the test")
    assert path.read_text().startswith("# from the test\n")
    serve = load_serve_config(path)
    pools = serve.pools
    assert (pools.prefill.replicas, pools.decode.replicas) == (0, 3) and pools.prefill.autoscaling is None
    scaling = pools.decode.autoscaling
    assert (scaling.min_replicas, scaling.max_replicas, scaling.tpot_slo_ms) == (3, 6, 25.0)
    # 100 req/s x 0.1 s held, over 3 replicas: 3.3 running each (a little more with the last ones' drain).
    assert scaling.target_running_requests == 4
    assert serve.engine.max_num_seqs == SLOTS  # the base file's settings are kept


def test_a_disaggregated_plan_writes_both_pools(one_option):
    c = next(c for c in one_option.meeting if c.prefill)
    serve = load_serve_config(None, cluster_yaml(c, SLOW, SLO_, headroom=1.5))
    prefill = serve.pools.prefill.autoscaling
    assert serve.pools.prefill.replicas == c.prefill and serve.pools.decode.replicas == c.decode
    assert (prefill.min_replicas, prefill.max_replicas, prefill.ttft_slo_ms) == (1, 2, 50.0)
    # What a replica prefills in half the TTFT SLO: 1,024 tokens a 10 ms step -> 102,400 tokens/s x 25 ms.
    assert prefill.target_queued_prompt_tokens == 2560


def test_no_autoscaling_without_ray_and_a_file_the_plan_cannot_serve_is_refused(one_option):
    best = one_option.meeting[0]
    data = cluster_yaml(best, SLOW, SLO_, {"launcher": "processes"})
    assert load_serve_config(None, data).pools.decode.autoscaling is None
    with pytest.raises(ConfigError, match="one model"):
        cluster_yaml(best, SLOW, SLO_, {"models": {"a": {}, "b": {}}})
    with pytest.raises(ConfigError, match="router.policy"):
        cluster_yaml(best, SLOW, SLO_, {"router": {"policy": "nope"}})


def test_plan_arguments_are_checked():
    with pytest.raises(ConfigError, match="--goodput"):
        plan(requests(10), SLO(), [SLOW])
    with pytest.raises(ConfigError, match="--target"):
        plan(requests(10), SLO_, [SLOW], target=1.5)
    with pytest.raises(ConfigError, match="--max-replicas"):
        plan(requests(10), SLO_, [SLOW], max_replicas=0)


# ---- the command line ---------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    profile().save(tmp_path / "slow.json")
    profile(STEP_S / 2).save(tmp_path / "fast.json")
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"engine": {"max_num_seqs": SLOTS, "num_kv_blocks": 4096}}))
    return tmp_path


WORKLOAD = ["--dataset-name", "random", "--random-input-len", str(PROMPT), "--random-output-len", str(OUTPUT),
            "--num-prompts", "400", "--request-rate", str(RATE), "--arrival", "constant", "--policy", "round_robin",
            "--goodput", "ttft:50", "tpot:25"]


def test_the_command_prints_the_plan_and_writes_the_cheapest(files, capsys):
    args = ["plan", "--profile", f"{files}/slow.json", "--profile", f"{files}/fast.json=1.4", "--config",
            f"{files}/base.yaml", *WORKLOAD, "--write", f"{files}/out.yaml", "--json", f"{files}/out.json",
            "--peak-rate", "300", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("1 |", "2 |", "3 |", "4 |", "missed |"))]
    assert lines[0].startswith("1 | fast | measured | colocated, 2 decode | 2 | 2.8 | 100.0%")
    assert lines[1].startswith("2 | slow | measured | colocated, 3 decode | 3 | 3 | 100.0%")
    assert len(lines) == 4 and lines[-1].startswith("missed | fast | measured | colocated, 1 decode")
    serve = load_serve_config(files / "out.yaml")
    assert serve.pools.decode.replicas == 2 and serve.pools.decode.autoscaling.max_replicas == 6  # 3x: peak/rate
    data = json.loads((files / "out.json").read_text())
    assert data["candidates"][0]["option"] == "fast" and data["candidates"][0]["meets"]


def test_nothing_meeting_is_said_and_exits_3(files, capsys):
    args = ["plan", "--profile", f"{files}/slow.json", "--config", f"{files}/base.yaml", *WORKLOAD,
            "--max-replicas", "2", "--write", f"{files}/never.yaml"]
    assert main(args) == 3
    out = capsys.readouterr().out
    assert "slow: nothing met the target within --max-replicas 2" in out
    assert "\nmissed | slow |" in out and not (files / "never.yaml").exists()


def test_a_roofline_plan_is_marked_modelled(capsys):
    args = ["plan", "--roofline", "h100-sxm", "--shape", "smollm2-135m", "--num-prompts", "20", "--request-rate",
            "5", "--random-input-len", "64", "--random-output-len", "8", "--goodput", "ttft:1000", "--max-replicas",
            "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(a roofline: modelled, not measured)" in out
    assert "1 | h100-sxm/smollm2-135m | modelled | colocated, 1 decode" in out


@pytest.mark.parametrize("flags, message", [
    (["--goodput", "ttft:50"], "--request-rate"),
    (["--request-rate", "5"], "--goodput"),
    (["--request-rate", "5", "--goodput", "ttfx:5"], "--goodput"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--profile", "p.json=cheap"], "--profile"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--roofline", "a100"], "--roofline"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--roofline", "l4", "--shape", "gpt-9"], "--shape"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--shape", "llama-3-8b"], "--shape"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--target", "1.5"], "--target"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--peak-rate", "2"], "--peak-rate"),
    (["--request-rate", "5", "--goodput", "ttft:50", "--profile", "/nonexistent.json"], "--profile"),
])
def test_bad_flags_name_the_flag(flags, message, capsys):
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve plan: error: ") and message in err, err


def test_the_help_lists_the_bench_workload_flags(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for flag in ("--dataset-name", "--random-input-len", "--arrival", "--profile PATH[=COST]", "--write PATH"):
        assert flag in out
    assert "--base-url" not in out and "--rates" not in out

