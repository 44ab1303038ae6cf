"""The cluster YAML: every example validates, flags override the file, bad files are refused
with a message naming the key (``pdserve config show`` run as a user would)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.cluster.config import ServeConfig, load_serve_config
from pdserve.configs import ConfigError
from pdserve.router.policy import DisaggregationConfig, PrefillInputs, prefill_route
from tests.cluster.test_cli import pdserve

EXAMPLES = sorted((Path(__file__).parents[2] / "deploy" / "examples").glob("*.yaml"))


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"single-machine.yaml", "colocated.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path):
    config = load_serve_config(path)
    assert isinstance(config, ServeConfig)
    assert all(m.pools.decode.replicas >= 1 for m in config.served())


def test_each_model_is_laid_over_the_shared_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine: {kv_cache_memory_gb: 1.5, max_num_seqs: 8}\npools: {decode: {replicas: 2}}\n"
                    "models:\n  small: {aliases: [s], engine: {model: smollm2-135m-instruct}}\n"
                    "  gemma-3-270m: {engine: {max_num_seqs: 4}, pools: {prefill: {replicas: 0}}}\n")
    small, gemma = load_serve_config(path).served()
    assert (small.name, small.aliases, small.engine.model) == ("small", ["s"], "smollm2-135m-instruct")
    assert (gemma.name, gemma.engine.model) == ("gemma-3-270m", "gemma-3-270m")  # engine.model: the name
    assert (small.engine.kv_cache_memory_gb, small.engine.max_num_seqs) == (1.5, 8)
    assert (gemma.engine.kv_cache_memory_gb, gemma.engine.max_num_seqs) == (1.5, 4)
    assert (small.pools.prefill.replicas, small.pools.decode.replicas) == (1, 2)
    assert (gemma.pools.prefill.replicas, gemma.pools.decode.replicas) == (0, 2)
    # flags win over a model's own sections too
    gemma = load_serve_config(path, {"engine": {"max_num_seqs": 2}, "pools": {"prefill": {"replicas": 1}}}).served()[1]
    assert (gemma.engine.max_num_seqs, gemma.pools.prefill.replicas) == (2, 1)


def test_model_repeated_on_the_command_line_serves_exactly_those(tmp_path):
    config = load_serve_config(None, models=["smollm2-135m-instruct", "gemma-3-270m"])
    assert [(m.name, m.engine.model, m.pools.decode.replicas) for m in config.served()] == [
        ("smollm2-135m-instruct", "smollm2-135m-instruct", 1), ("gemma-3-270m", "gemma-3-270m", 1)]
    assert [m.name for m in load_serve_config(None, models=["gemma-3-270m"]).served()] == [""]  # one: as before
    path = tmp_path / "c.yaml"
    path.write_text("models: {a: {aliases: [x], engine: {model: smollm2-135m-instruct}}, b: {}}\n")
    (a,) = load_serve_config(path, models=["a"]).served()  # the file's settings for a name it has
    assert (a.name, a.aliases) == ("a", ["x"])
    with pytest.raises(ConfigError, match="named twice"):
        load_serve_config(None, models=["a", "a"])


def test_the_processes_launcher_starts_each_models_pools_under_its_name():
    from pdserve.cluster.serve_cli import _worker_commands

    config = load_serve_config(None, {"launcher": "processes", "pools": {"prefill": {"replicas": 0}},
                                      "models": {"small": {"engine": {"model": "smollm2-135m-instruct"}},
                                                 "gemma-3-270m": {"pools": {"decode": {"replicas": 2}}}}})
    commands = _worker_commands(config, grace_s=5.0)
    assert [role for role, _ in commands] == ["decode", "decode", "decode"]
    named = [(flags[flags.index("--served-model-name") + 1], flags[flags.index("--model") + 1])
             for _, flags in commands]
    assert named == [("small", "smollm2-135m-instruct"), ("gemma-3-270m", "gemma-3-270m"),
                     ("gemma-3-270m", "gemma-3-270m")]
    assert all("--served-model-name" not in flags for _, flags in _worker_commands(load_serve_config(None), 5.0))


def test_serve_step_trace_goes_to_every_worker_and_needs_a_pid_in_the_path(capsys):
    from pdserve.cluster.cli import main
    from pdserve.cluster.serve_cli import _worker_commands

    config = load_serve_config(None, {"launcher": "processes", "pools": {"prefill": {"replicas": 1}}})
    commands = _worker_commands(config, 5.0, "traces/{pid}.jsonl")
    assert [role for role, _ in commands] == ["prefill", "decode"]
    assert all(flags[flags.index("--step-trace") + 1] == "traces/{pid}.jsonl" for _, flags in commands)
    assert all("--step-trace" not in flags for _, flags in _worker_commands(config, 5.0))
    assert main(["serve", "--launcher", "processes", "--step-trace", "trace.jsonl"]) == 2
    assert "--step-trace: put {pid} in the path ('trace.jsonl'): every worker writes a file of its own" in (
        capsys.readouterr().err)
    assert main(["serve", "--launcher", "ray", "--step-trace", "t.jsonl"]) == 2  # Ray replicas: the same rule
    assert "--step-trace: put {pid} in the path" in capsys.readouterr().err


def test_defaults_serve_disaggregated():
    config = load_serve_config(None)
    assert (config.pools.prefill.replicas, config.pools.decode.replicas) == (1, 1)
    assert config.kv_transfer.backend == "grpc"


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("router: {disagg_min_prompt_tokens: 300, port: 9000}\npools: {decode: {replicas: 2}}\n")
    config = load_serve_config(path, {"router": {"port": 9100}})
    assert (config.router.port, config.router.disagg_min_prompt_tokens) == (9100, 300)
    assert config.pools.decode.replicas == 2 and config.pools.prefill.replicas == 1


def test_the_yaml_thresholds_drive_the_disaggregation_decision(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("router: {disagg_min_prompt_tokens: 500, disagg_min_uncached_tokens: 100}\n")
    router = load_serve_config(path).router
    decision = DisaggregationConfig(router.disagg_min_prompt_tokens, router.disagg_min_uncached_tokens)
    assert prefill_route(PrefillInputs(499, True), decision) == "local_short"
    assert prefill_route(PrefillInputs(800, True, reserved=True, cached_tokens=750), decision) == "local_cached"
    assert prefill_route(PrefillInputs(800, True, reserved=True), decision) == "remote"


@pytest.mark.parametrize(("text", "message"), [
    ("router: {polcy: x}", "config.router: unknown key(s) ['polcy']"),
    ("routr: {}", "config: unknown key(s) ['routr']"),
    ("router: {port: eighty}", "config.router.port: expected int, got str 'eighty'"),
    ("router: {policy: fastest}", "config.router.policy: 'fastest' is not one of"),
    ("pools: {decode: {replicas: 0}}", "pools.decode.replicas: at least one decode worker is needed, got 0"),
    ("pools: {prefill: {replicas: -1}}", "pools.prefill.replicas: must not be negative"),
    ("kv_transfer: {backend: rdma}", "config.kv_transfer.backend: 'rdma' is not one of ['grpc', 'torch']"),
    ("kv_transfer: {lease_ms: 0}", "kv_transfer.lease_ms: must be positive"),
    ("router: {disagg_min_prompt_tokens: -5}", "router.disagg_min_prompt_tokens: must not be negative"),
    ("- 1\n- 2", "must hold a mapping of sections, got list"),
    ("router: [1", "is not valid YAML"),
    # several models (models:)
    ("models: [a, b]", "models: expected a mapping of model names"),
    ("models: {a: {aliases: [b]}, b: {}}", "models.b: the name 'b' is already taken by models.a"),
    ("models: {a: {engine: {modle: x}}}", "config.models.a.engine: unknown key(s) ['modle']"),
    ("models: {a: {pools: {decode: {replicas: 0}}}}", "config.models.a.pools.decode.replicas: at least one decode"),
    ("models: {a: {name: b}}", "models.a.name: the name is the key"),
    ("models: {a: 3}", "models.a: expected a mapping"),
])
def test_bad_configs_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_serve_config(path)
    assert message in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read .*nope.yaml"):
        load_serve_config(tmp_path / "nope.yaml")


def test_config_show_prints_the_effective_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("router: {disagg_min_uncached_tokens: 32}\n")
    out = pdserve("config", "show", "--config", str(path), "--prefill", "0", "--max-num-seqs", "8")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["router"]["disagg_min_uncached_tokens"] == 32
    assert shown["pools"]["prefill"]["replicas"] == 0
    assert shown["engine"]["max_num_seqs"] == 8
    assert shown["engine"]["block_size"] == 16  # defaults filled in
    assert load_serve_config(None, shown) == load_serve_config(path, {"pools": {"prefill": {"replicas": 0}},
                                                                      "engine": {"max_num_seqs": 8}})


def test_config_show_refuses_a_bad_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pools: {decode: {replicas: 0}}\n")
    out = pdserve("config", "show", "--config", str(path))
    assert out.returncode == 2
    assert "pools.decode.replicas" in out.stderr


def test_a_worker_named_after_one_of_the_models_runs_that_models_engine():
    from pdserve.cluster.serve_cli import worker_engine
    from pdserve.worker.config import WorkerConfig

    config = load_serve_config(None, {"engine": {"max_num_seqs": 8},
                                      "models": {"small": {"engine": {"model": "smollm2-135m-instruct"}},
                                                 "gemma-3-270m": {"engine": {"max_model_len": 8192}}}})
    gemma = worker_engine(config, WorkerConfig(served_model_name="gemma-3-270m"))
    assert (gemma.model, gemma.max_model_len, gemma.max_num_seqs) == ("gemma-3-270m", 8192, 8)
    assert worker_engine(config, WorkerConfig(served_model_name="small")).model == "smollm2-135m-instruct"
    assert worker_engine(config, WorkerConfig()) == config.engine  # a worker of no listed model: the section


def test_cascades_name_served_models_and_no_served_name(tmp_path):
    models = "models: {small-int4: {engine: {model: smollm2-135m-instruct, quantization: int4}}, " \
             "small: {engine: {model: smollm2-135m-instruct}}}\n"
    path = tmp_path / "c.yaml"
    path.write_text(models + "cascades: {auto: {stages: [small-int4, small], accept_mean_logprob: -0.8}}\n")
    (cascade,) = load_serve_config(path).cascades.values()
    assert (cascade.stages, cascade.accept_mean_logprob) == (["small-int4", "small"], -0.8)
    for text, message in (("{auto: {stages: [small-int4, big], accept_mean_logprob: -1}}", "'big' is not a served"),
                          ("{small: {stages: [small-int4, small], accept_mean_logprob: -1}}", "taken by a served"),
                          ("{auto: {stages: [small-int4, small]}}", "set at least one")):
        path.write_text(models + f"cascades: {text}\n")
        with pytest.raises(ConfigError, match=message):
            load_serve_config(path)
