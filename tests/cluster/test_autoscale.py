"""The autoscaling policy as a pure function: up, down, hold, bounds, stabilisation, step
limits, scale to and from zero, and no oscillation on a constant signal."""

from __future__ import annotations

import pytest

from pdserve.cluster.autoscale import AutoscalingConfig, PoolPolicy, PoolSignals
from pdserve.configs import ConfigError

FAST = dict(upscale_window_s=10, downscale_window_s=30, max_step=1)


def drive(policy: PoolPolicy, signals_at, start: int, seconds: int, tick: int = 1) -> list[int]:
    """Run the policy every ``tick`` seconds, applying each decision at once; the replica
    counts after each decision."""
    replicas, seen = start, []
    for now in range(0, seconds, tick):
        decision = policy.decide(signals_at(now, replicas), float(now))
        replicas = decision.desired
        seen.append(replicas)
    return seen


@pytest.mark.parametrize(("role", "signals", "expected_raw", "reason"), [
    ("prefill", PoolSignals(replicas=1, queued_prompt_tokens=20_000), 3, "queued_prompt_tokens"),
    ("prefill", PoolSignals(replicas=2, queued_prompt_tokens=100, ttft_p90_ms=900), 3, "ttft_p90_over_slo"),
    ("prefill", PoolSignals(replicas=2, queued_prompt_tokens=100, ttft_p90_ms=100), 1, "queued_prompt_tokens"),
    ("decode", PoolSignals(replicas=1, running_requests=70), 3, "running_requests"),
    ("decode", PoolSignals(replicas=2, running_requests=10, kv_usage=0.95), 3, "kv_usage"),
    ("decode", PoolSignals(replicas=2, running_requests=10, kv_usage=0.5, tpot_p90_ms=80), 3, "tpot_p90_over_slo"),
    ("decode", PoolSignals(replicas=3, running_requests=1), 1, "running_requests"),
    ("decode", PoolSignals(replicas=1), 0, "running_requests"),
])
def test_each_signal_asks_for_replicas(role, signals, expected_raw, reason):
    config = AutoscalingConfig(max_replicas=8, target_queued_prompt_tokens=8192, target_running_requests=32,
                               target_kv_usage=0.8, ttft_slo_ms=500, tpot_slo_ms=50)
    raw, why = PoolPolicy(role, config).recommend(signals)
    assert (raw, why) == (expected_raw, reason)


def test_scale_up_waits_for_the_window_then_steps_one_at_a_time():
    policy = PoolPolicy("decode", AutoscalingConfig(min_replicas=1, max_replicas=4, **FAST))
    seen = drive(policy, lambda now, r: PoolSignals(replicas=r, running_requests=200), 1, 40)
    assert seen[:10] == [1] * 10  # not sustained yet
    assert seen[10] == 2  # one step after the window
    assert seen[-1] == 4 and max(seen) == 4  # capped at max_replicas
    assert all(b - a <= 1 for a, b in zip(seen, seen[1:]))  # max_step


def test_a_short_burst_does_not_scale_up():
    policy = PoolPolicy("prefill", AutoscalingConfig(max_replicas=4, **FAST))
    seen = drive(policy, lambda now, r: PoolSignals(replicas=r, queued_prompt_tokens=50_000 if now < 5 else 0),
                 1, 60)
    assert set(seen) == {1}


def test_scale_down_waits_for_the_longer_quiet_window():
    policy = PoolPolicy("decode", AutoscalingConfig(min_replicas=1, max_replicas=4, **FAST))
    seen = drive(policy, lambda now, r: PoolSignals(replicas=r, running_requests=4), 3, 90)
    assert seen[:30] == [3] * 30
    assert seen[30] == 2 and seen[-1] == 1  # one step at a time, never below min_replicas


@pytest.mark.parametrize("running", [0, 31, 32, 33, 64, 65, 100, 127])
def test_no_oscillation_on_a_constant_signal(running):
    """However the constant load sits against the targets, the count moves one way only, at
    most one step per stabilisation window, and settles."""
    policy = PoolPolicy("decode", AutoscalingConfig(min_replicas=1, max_replicas=6, **FAST))
    seen = drive(policy, lambda now, r: PoolSignals(replicas=r, running_requests=running), 2, 300)
    moves = [b - a for a, b in zip(seen, seen[1:]) if b != a]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves)
    assert seen[-60:] == [seen[-1]] * 60  # settled
    changes = [i for i, (a, b) in enumerate(zip(seen, seen[1:])) if a != b]
    assert all(b - a >= 10 for a, b in zip(changes, changes[1:]))  # at most one per upscale window


def test_scale_to_zero_and_back_from_a_waiting_request():
    policy = PoolPolicy("prefill", AutoscalingConfig(min_replicas=0, max_replicas=2, **FAST))
    idle = drive(policy, lambda now, r: PoolSignals(replicas=r), 1, 40)
    assert idle[-1] == 0
    decision = policy.decide(PoolSignals(replicas=0, waiting_for_replica=1), 41.0)
    assert (decision.desired, decision.reason) == (1, "cold_start")


def test_bounds_hold_against_any_signal():
    policy = PoolPolicy("decode", AutoscalingConfig(min_replicas=2, max_replicas=3, upscale_window_s=0,
                                                    downscale_window_s=0, max_step=5))
    assert policy.decide(PoolSignals(replicas=2, running_requests=10_000), 0.0).desired == 3
    assert policy.decide(PoolSignals(replicas=3), 1.0).desired == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas (3) > max_replicas (2)"),
    ({"min_replicas": -1}, "autoscaling.min_replicas: must not be negative"),
    ({"min_replicas": 0, "max_replicas": 0}, "autoscaling.max_replicas: must be at least 1"),
    ({"target_kv_usage": 1.5}, "autoscaling.target_kv_usage: must be in (0, 1]"),
    ({"max_step": 0}, "autoscaling.max_step: must be at least 1"),
    ({"upscale_window_s": -1}, "autoscaling.upscale_window_s: must not be negative"),
])
def test_bad_policies_are_refused_naming_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        AutoscalingConfig(**options)
    assert message in str(info.value)


def test_ticks_that_never_land_on_the_window_still_scale_down():
    """Serve calls the policy every ~0.1 s at float times: the window must still count as covered."""
    policy = PoolPolicy("decode", AutoscalingConfig(min_replicas=1, max_replicas=2, upscale_window_s=2,
                                                    downscale_window_s=6))
    replicas, now = 2, 0.037
    while now < 10 and replicas == 2:
        replicas = policy.decide(PoolSignals(replicas=replicas), now).desired
        now += 0.1003
    assert replicas == 1 and 6 <= now < 6.5


def test_a_size_change_the_policy_did_not_make_restarts_the_windows():
    """Serve's cold start takes a pool from 0 to 1 on its own: the quiet seen at zero must not take it
    straight back to zero."""
    policy = PoolPolicy("decode", AutoscalingConfig(min_replicas=0, max_replicas=2, upscale_window_s=1,
                                                    downscale_window_s=4))
    for now in range(10):  # idle at zero for longer than the window
        assert policy.decide(PoolSignals(replicas=0), float(now)).desired == 0
    replicas, seen = 1, []  # Serve started one for a waiting request; it was served at once
    for now in range(10, 16):
        replicas = policy.decide(PoolSignals(replicas=replicas), float(now)).desired
        seen.append(replicas)
    assert seen == [1, 1, 1, 1, 0, 0]  # a full downscale window at one replica first
