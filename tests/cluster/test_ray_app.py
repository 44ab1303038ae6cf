"""The Ray Serve application without a Ray cluster: the deployments' options from the YAML, the
policy adapter between Serve's AutoscalingContext and the pure policy, the placement check, and
the config errors of the Ray keys. (tests/integration/test_ray_serve.py runs it on real Ray.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pdserve.cluster import ray_app
from pdserve.cluster.config import load_serve_config
from pdserve.cluster.ray_app import PoolAutoscalingPolicy, deployment_options, signals_from_context
from pdserve.cluster.ray_launcher import check_placement
from pdserve.configs import ConfigError

AUTOSCALED = {
    "pools": {
        "prefill": {"replicas": 1, "num_cpus": 2, "resources": {"prefill": 1}, "placement_strategy": "spread"},
        "decode": {"replicas": 2, "num_gpus": 1, "resources": {"decode": 1}, "grace_s": 20,
                   "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_running_requests": 8,
                                   "upscale_window_s": 5, "downscale_window_s": 20}},
    },
    "ray": {"metrics_interval_s": 0.5},
}


def test_a_fixed_pool_gets_its_placement_and_size():
    options = deployment_options(load_serve_config(None, AUTOSCALED), "prefill")
    assert options["name"] == "PrefillWorker" and options["num_replicas"] == 1
    assert "autoscaling_config" not in options
    actor = options["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"], actor["resources"]) == (2.0, 0.0, {"prefill": 1.0})
    assert options["max_replicas_per_node"] == 1  # spread
    assert actor["runtime_env"]["env_vars"]["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "0.5"


def test_an_autoscaled_pool_plugs_in_our_policy_with_serve_delays_off():
    options = deployment_options(load_serve_config(None, AUTOSCALED), "decode")
    assert "num_replicas" not in options and "max_replicas_per_node" not in options
    auto = options["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"]) == (1, 4, 2)
    assert auto["upscale_delay_s"] == auto["downscale_delay_s"] == 0  # our windows are the stabilisation
    assert auto["policy"]["policy_function"] == "pdserve.cluster.ray_app:PoolAutoscalingPolicy"
    kwargs = auto["policy"]["policy_kwargs"]
    assert kwargs["role"] == "decode" and kwargs["target_running_requests"] == 8
    assert options["graceful_shutdown_timeout_s"] >= 20  # the drain fits in Serve's shutdown
    # What Serve itself accepts (its pydantic models), and the policy Serve would build from it.
    from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig

    RayAutoscalingConfig(**auto)
    policy = PoolAutoscalingPolicy(**kwargs)
    assert policy.policy.config.max_replicas == 4 and policy.role == "decode"


def ctx(current: int, metrics: dict[str, list[float]], total_requests: float = 0.0, target: int | None = None):
    """A stand-in for Serve's AutoscalingContext: what the policy reads of it."""
    return SimpleNamespace(
        current_num_replicas=current, target_num_replicas=current if target is None else target,
        total_num_requests=total_requests, policy_state={},
        aggregated_metrics={name: {f"replica-{i}": v for i, v in enumerate(values)}
                            for name, values in metrics.items()})


def test_signals_sum_the_replicas_and_take_the_worst_latency():
    s = signals_from_context(ctx(2, {"queued_prompt_tokens": [100, 300], "running_requests": [3, 5],
                                     "kv_usage": [0.2, 0.6], "ttft_p90_ms": [0, 250], "tpot_p90_ms": [40, 30]}))
    assert (s.replicas, s.queued_prompt_tokens, s.running_requests) == (2, 400, 8)
    assert s.kv_usage == pytest.approx(0.4)
    assert (s.ttft_p90_ms, s.tpot_p90_ms) == (250, 40)
    idle = signals_from_context(ctx(1, {"running_requests": [0], "ttft_p90_ms": [0]}))
    assert idle.ttft_p90_ms is None and idle.running_requests == 0  # 0 ms: nothing measured in the window


def test_a_pool_busy_for_part_of_the_look_back_is_not_idle():
    """Serve averages each replica's reports over its look-back: one request in half the window is
    0.5, which rounding to the nearest would call idle (and a pool at min_replicas 0 would go to zero)."""
    s = signals_from_context(ctx(1, {"running_requests": [0.5], "queued_prompt_tokens": [0.25]}))
    assert (s.running_requests, s.queued_prompt_tokens) == (1, 1)
    policy = PoolAutoscalingPolicy("decode", min_replicas=0, max_replicas=1, downscale_window_s=0)
    assert policy(ctx(1, {"running_requests": [0.5]}))[0] == 1
    assert policy(ctx(1, {"running_requests": [0.0]}))[0] == 0


def test_a_request_served_between_two_reports_counts_as_load():
    """Serve samples a replica's load every metrics interval; a short request between two samples
    must still keep the pool from looking idle."""
    import asyncio

    from pdserve.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    load = SimpleNamespace(waiting_prompt_tokens=0, num_running=0, num_waiting=0, kv_usage=0.0)
    class Replica(ray_app.DecodeWorker.func_or_class):  # the replica's class, without its engine
        def __del__(self):  # Serve awaits the real one (the drain); here there is nothing to drain
            pass

    worker = object.__new__(Replica)
    worker.server = SimpleNamespace(servicer=SimpleNamespace(snapshot=lambda: load, metrics=metrics))
    assert asyncio.run(worker.record_autoscaling_stats())["running_requests"] == 0
    metrics.requests.labels("stop").inc()  # started and finished since the last report
    assert asyncio.run(worker.record_autoscaling_stats())["running_requests"] == 1
    assert asyncio.run(worker.record_autoscaling_stats())["running_requests"] == 0  # nothing since
    load.num_running = 3
    assert asyncio.run(worker.record_autoscaling_stats())["running_requests"] == 3


def test_requests_waiting_for_a_pool_at_zero_are_the_cold_start_signal():
    assert signals_from_context(ctx(0, {}, total_requests=3)).waiting_for_replica == 3
    assert signals_from_context(ctx(1, {"running_requests": [2]}, total_requests=3)).waiting_for_replica == 0


class FakeGauge:
    def __init__(self):
        self.values = {}

    def set(self, value, tags):
        self.values[tags["pool"]] = value


def test_the_policy_adapter_decides_logs_and_exports(monkeypatch, caplog):
    desired, actual = FakeGauge(), FakeGauge()
    monkeypatch.setattr(ray_app, "_gauges", lambda: (desired, actual))
    clock = iter(range(0, 1000))
    monkeypatch.setattr(ray_app.time, "monotonic", lambda: float(next(clock)))
    policy = PoolAutoscalingPolicy("decode", min_replicas=1, max_replicas=3, target_running_requests=4,
                                   upscale_window_s=2, downscale_window_s=4)
    caplog.set_level(logging.INFO, logger="ray.serve.pdserve.autoscaler.decode")
    decisions, target = [], 1
    for _ in range(4):  # Serve's target follows the decisions; the running replica count lags behind
        target = policy(ctx(1, {"running_requests": [12], "kv_usage": [0.1]}, target=target))[0]
        decisions.append(target)
    assert decisions == [1, 1, 2, 2]  # the load had to last upscale_window_s; then one step, kept while it starts
    assert (desired.values["decode"], actual.values["decode"]) == (2, 1)
    moves = [r.getMessage() for r in caplog.records if "-> 2 replicas" in r.getMessage()]
    assert moves and "running_requests" in moves[0] and "'running_requests': 12" in moves[0]  # with its inputs


def test_the_policy_adapter_refuses_a_bad_role_or_key():
    with pytest.raises(ValueError, match="role"):
        PoolAutoscalingPolicy("router", max_replicas=2)
    with pytest.raises(ConfigError, match=r"pools.decode.autoscaling: unknown key\(s\) \['max_replica'\]"):
        PoolAutoscalingPolicy("decode", max_replica=2)


def test_the_application_builder_refuses_bad_args_before_deploying():
    with pytest.raises(ConfigError, match=r"args: unknown key\(s\) \['clustr'\]"):
        ray_app.build_app({"clustr": {}})
    with pytest.raises(ConfigError, match=r"args: step_trace 'trace.jsonl': a path with \{pid\} in it"):
        ray_app.build_app({"cluster": {}, "step_trace": "trace.jsonl"})
    with pytest.raises(ConfigError, match="config.pools.decode.autoscaling: min_replicas"):
        ray_app.build_app({"cluster": {"pools": {"decode": {"autoscaling": {"min_replicas": 3,
                                                                            "max_replicas": 2}}}}})


def test_each_model_gets_its_own_deployment_pair_with_its_pools():
    config = load_serve_config(None, {"models": {
        "smollm2-135m-instruct": {"pools": {"prefill": {"replicas": 0}}},
        "gemma-3-270m": {"pools": {"decode": {"replicas": 2, "num_cpus": 2}}}}})
    names = [deployment_options(config, role, model=m.name)["name"] for m in config.served()
             for role in ("prefill", "decode")]
    assert names == ["PrefillWorker-smollm2-135m-instruct", "DecodeWorker-smollm2-135m-instruct",
                     "PrefillWorker-gemma-3-270m", "DecodeWorker-gemma-3-270m"]
    assert deployment_options(config, "prefill", model="smollm2-135m-instruct")["num_replicas"] == 0
    gemma = deployment_options(config, "decode", model="gemma-3-270m")
    assert (gemma["num_replicas"], gemma["ray_actor_options"]["num_cpus"]) == (2, 2.0)
    with pytest.raises(ConfigError, match=r"models.gemma-3-270m.pools.decode.num_cpus: each decode replica needs 2"):
        check_placement(config, node_resources=[{"CPU": 1.0}])


NODES = [{"CPU": 8.0, "prefill": 1.0}, {"CPU": 8.0, "GPU": 1.0, "decode": 2.0}]


@pytest.mark.parametrize(("pools", "message"), [
    ({"decode": {"resources": {"decode_h100": 1}}}, "pools.decode.resources.decode_h100: each decode replica needs 1"),
    ({"prefill": {"resources": {"prefill": 2}}}, "pools.prefill.resources.prefill: each prefill replica needs 2 "
                                                 "prefill, and no Ray node has that much (most on one node: 1)"),
    ({"prefill": {"num_gpus": 1, "resources": {"prefill": 1}}}, "pools.prefill: each prefill replica needs "
                                                                "{'CPU': 1.0, 'GPU': 1.0, 'prefill': 1}, and no Ray "
                                                                "node has all of it"),
    ({"decode": {"num_cpus": 16}}, "pools.decode.num_cpus"),
])
def test_a_pool_no_node_can_hold_is_refused_naming_the_key(pools, message):
    config = load_serve_config(None, {"pools": pools})
    with pytest.raises(ConfigError) as info:
        check_placement(config, node_resources=NODES)
    assert message in str(info.value)


def test_placement_that_fits_passes_and_a_joined_cluster_only_warns(caplog):
    fits = {"prefill": {"resources": {"prefill": 1}}, "decode": {"num_gpus": 1, "resources": {"decode": 2}}}
    check_placement(load_serve_config(None, {"pools": fits}), node_resources=NODES)
    # a prefill pool of 0 replicas and no autoscaling is not placed at all
    check_placement(load_serve_config(None, {"pools": {"prefill": {"replicas": 0, "resources": {"x": 1}}}}),
                    node_resources=NODES)
    joined = load_serve_config(None, {"pools": {"decode": {"resources": {"decode_h100": 1}}},
                                      "ray": {"address": "auto"}})
    check_placement(joined, node_resources=NODES)  # KubeRay may add such a node
    assert "decode_h100" in caplog.text


@pytest.mark.parametrize(("overrides", "message"), [
    ({"pools": {"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 1}}}},
     "config.pools.decode.autoscaling: min_replicas (3) > max_replicas (1)"),
    ({"pools": {"decode": {"autoscaling": {"max_replicas": 2, "targt": 1}}}},
     "config.pools.decode.autoscaling: unknown key(s) ['targt']"),
    ({"pools": {"decode": {"replicas": 5, "autoscaling": {"max_replicas": 2}}}},
     "pools.decode.replicas (5) must be within pools.decode.autoscaling's min_replicas (1) and max_replicas (2)"),
    ({"pools": {"prefill": {"placement_strategy": "pack"}}},
     "config.pools.prefill.placement_strategy: 'pack' is not one of ['default', 'spread']"),
    ({"pools": {"decode": {"resources": {"decode": -1}}}}, "pools.decode.resources.decode: expected a non-negative"),
    ({"pools": {"decode": {"num_cpus": "lots"}}}, "config.pools.decode.num_cpus: expected float, got str 'lots'"),
    ({"pools": {"decode": {"autoscaling": {"max_replicas": "2"}}}},
     "config.pools.decode.autoscaling.max_replicas: expected int, got str '2'"),
    ({"ray": {"adress": "auto"}}, "config.ray: unknown key(s) ['adress']"),
    ({"ray": {"router_replicas": 0}}, "config.ray.router_replicas: must be at least 1"),
    ({"launcher": "processes", "pools": {"decode": {"autoscaling": {"max_replicas": 2}}}},
     "pools.decode.autoscaling: needs launcher: ray"),
    ({"launcher": "kubernetes"}, "config.launcher: 'kubernetes' is not one of ['ray', 'processes']"),
])
def test_bad_ray_and_autoscaling_keys_are_named(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_serve_config(None, overrides)
    assert message in str(info.value)


def test_decode_may_start_at_zero_only_when_it_can_scale_from_zero():
    config = load_serve_config(None, {"pools": {"decode": {"replicas": 0, "autoscaling": {"min_replicas": 0,
                                                                                       "max_replicas": 2}}}})
    assert config.pools.decode.replicas == 0
    waker = ray_app.PoolWaker(config.pools, {"prefill": object(), "decode": object()})
    assert waker.can_wake("decode") and not waker.can_wake("prefill")  # prefill has no autoscaling here
    assert waker.timeouts["decode"] == config.pools.decode.autoscaling.cold_start_timeout_s


def test_shutdown_leaves_ray_only_after_a_deploy_thread_still_in_serve_run_has_ended(monkeypatch):
    """A stop that lands while ``serve.run`` still polls the controller (the router can answer
    /ready before Serve calls the application RUNNING): the thread's Ray call, caught by
    ``ray.shutdown()``, ended the whole process with status 1. The app is deleted first (the poll
    then raises), and only then does this process leave Ray."""
    import threading
    import time

    from pdserve.cluster import ray_launcher

    deleted = threading.Event()

    def serve_run():  # polls like Serve's client: raises once the application is gone
        while not deleted.wait(0.05):
            pass
        time.sleep(0.2)  # the poll's sleep: still running when shutdown reaches the join
        raise RuntimeError("Waiting for application pdserve to be RUNNING, but application doesn't exist.")

    def run():
        try:
            serve_run()
        except RuntimeError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen = {}
    serve = SimpleNamespace(delete=lambda name: deleted.set(), shutdown=lambda: None)
    monkeypatch.setattr(ray_launcher, "_import_ray", lambda: (None, serve))
    monkeypatch.setattr(ray_launcher, "disconnect", lambda: seen.setdefault("deploy alive", thread.is_alive()))
    config = load_serve_config(None, {})
    assert ray_launcher.shutdown(config, None, [thread])
    assert seen == {"deploy alive": False}
