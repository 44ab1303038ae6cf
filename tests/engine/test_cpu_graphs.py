"""Decode steps replayed from a recorded tape of kernel calls (engine/cpu_graphs.py): the same tokens as eager
steps, bit for bit; what cannot be replayed runs eagerly."""

from __future__ import annotations

import logging

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.cpu_kernels import load_kernels
from pdserve.engine.quant.qdot import supports
from tests.conftest import assert_no_leaks, run_to_completion

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C compiler: no kernels to record")


def engine_for(loaded, graphs: int, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.source.name, load_progress=False, num_kv_blocks=256,
                                  cpu_graph_max_batch=graphs, **options), loaded=loaded)


def shrinking_batch(engine: LLMEngine) -> dict[str, list[int]]:
    """Ten requests of different lengths: decode steps of 10 requests down to 1 as they finish (the sizes past
    the graphs' bound run eagerly)."""
    for i in range(10):
        engine.add_request(f"r{i}", [100 + 7 * i + j for j in range(9 + 5 * i)],
                           SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True))
    return run_to_completion(engine)


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "bfloat16"},
                                     {"quantization": "int4"}], ids=["float32", "int8-kv", "bf16-kv", "int4"])
def test_replayed_steps_give_the_eager_tokens(default_model, options):
    if options.get("quantization") == "int4" and not supports(load_kernels(), 4):
        pytest.skip("no byte dot products here: int4 multiplies through torch, which is not recorded")
    loaded = default_model
    if "quantization" in options:
        from pdserve.engine.loader import load_model

        loaded = load_model(quantization=options["quantization"], progress=False)
    eager = engine_for(loaded, 0, **options)
    graphed = engine_for(loaded, 8, **options)
    assert eager.runner.cpu_graphs is None
    want, got = shrinking_batch(eager), shrinking_batch(graphed)
    assert got == want
    graphs = graphed.runner.cpu_graphs.graphs
    assert sorted(graphs) == list(range(1, 9)) and all(g is not None and g.checked for g in graphs.values())
    # each batch size recorded once: the last request's steps past it were replays
    assert_no_leaks(graphed)


def test_a_forward_the_tape_cannot_hold_runs_eagerly(default_model, caplog):
    """The torch attention path calls torch functions the recording does not replay (softmax, matmuls):
    refused at once, every size runs eagerly, the tokens unchanged."""
    with caplog.at_level(logging.INFO, logger="pdserve.engine.cpu_graphs"):
        graphed = engine_for(default_model, 4, attention_backend="torch")
        got = shrinking_batch(graphed)
    assert got == shrinking_batch(engine_for(default_model, 0, attention_backend="torch"))
    assert set(graphed.runner.cpu_graphs.graphs.values()) == {None}
    assert "not recorded (torch function" in caplog.text


def test_a_replay_that_differs_from_the_eager_step_is_dropped(default_model, caplog):
    """The first replay of a size is checked against an eager step: a tape that computes something else
    (here its last kernel call left out) is dropped, and the step's tokens are the eager ones."""
    eager, graphed = engine_for(default_model, 0), engine_for(default_model, 1)
    runner = graphed.runner.cpu_graphs
    record = runner._record

    def record_then_break(n, meta):
        logits = record(n, meta)
        runner.graphs[n].tape.pop()  # the output head's call: replays leave the logits as they were
        return logits

    runner._record = record_then_break
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for engine in (eager, graphed):
        engine.add_request("a", list(range(100, 120)), params)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.cpu_graphs"):
        assert run_to_completion(graphed) == run_to_completion(eager)
    assert runner.graphs == {1: None}
    assert "differs from the eager step" in caplog.text


def test_a_kernel_failure_in_a_replay_runs_the_step_eagerly(default_model):
    """A kernel that reports a failure (no memory for its scratch) ends the replay; the step runs eagerly."""
    eager, graphed = engine_for(default_model, 1), engine_for(default_model, 1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for engine in (eager, graphed):
        engine.add_request("a", list(range(100, 120)), params)
    runner = graphed.runner.cpu_graphs
    eager_steps = []
    forward = runner._eager
    runner._eager = lambda *a: eager_steps.append(1) or forward(*a)
    got = [t for _ in range(2) for o in graphed.step() for t in o.new_token_ids]  # the prompt; a decode step (recorded)
    tape = runner.graphs[1].tape
    i = next(i for i, e in enumerate(tape) if e[0] == "c" and e[3])  # a call whose answer is checked
    tape[i] = ("c", lambda *args: 1, (), True)
    before = len(eager_steps)
    got += [t for o in graphed.step() for t in o.new_token_ids]
    assert len(eager_steps) == before + 1  # the replay failed: the step ran eagerly
    got += run_to_completion(graphed)["a"]
    assert got == run_to_completion(eager)["a"]


def test_steps_past_the_few_rows_kernels_replay_onednn():
    """A bf16 model's projections of more rows than its C kernels take go through oneDNN's packed weights (tensors
    without storage of their own), the rows padded: recorded and replayed too, the tokens those of eager steps."""
    from pdserve.engine.loader import load_model
    from pdserve.engine.quant.formats import BF16Linear

    loaded = load_model(quantization="bf16", progress=False)
    layers = [m for m in loaded.model.modules() if type(m) is BF16Linear]
    if not layers or layers[0].packed is None:
        pytest.skip("no oneDNN bfloat16 path here")
    for m in layers:
        m.few_rows = 2
    options = {"quantization": "bf16", "kv_cache_dtype": "bfloat16"}
    graphed = engine_for(loaded, 8, **options)
    assert shrinking_batch(graphed) == shrinking_batch(engine_for(loaded, 0, **options))
    graphs = graphed.runner.cpu_graphs.graphs
    assert sorted(graphs) == list(range(1, 9)) and all(g is not None and g.checked for g in graphs.values())
    assert_no_leaks(graphed)
