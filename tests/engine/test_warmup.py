"""The engine's start-up warm-up (EngineConfig.warmup): oneDNN builds its kernel for every row bucket
of a step before serving, so no step size met under load builds one (nor grows the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine import EngineConfig
from pdserve.engine.engine import warmup_wanted
from pdserve.engine.model import Linear, warm_up_projections

# A fresh process (oneDNN's primitive cache is per process) that starts an engine with or without the
# warm-up, then serves prompts of many lengths; oneDNN reports each kernel it builds (ONEDNN_VERBOSE).
_PROBE = """
import json, sys
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
quantization = sys.argv[2].removeprefix("quantization=") if sys.argv[2:] and "=" in sys.argv[2] else "none"
draft = ({"method": "draft", "model": "random:" + sys.argv[2], "num_speculative_tokens": 2}
         if sys.argv[2:] and "=" not in sys.argv[2] else None)
engine = LLMEngine(EngineConfig(model="random:tiny", num_kv_blocks=256, max_num_batched_tokens=256,
                                max_num_seqs=8, load_progress=False, enable_prefix_caching=False,
                                warmup=sys.argv[1] == "on", speculative_config=draft, quantization=quantization))
print("SERVING", flush=True)
tokens = {}
for i, n in enumerate((9, 23, 40, 77, 130, 201, 256, 300)):
    engine.add_request(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
path = getattr(engine.loaded.model.layers[0].mlp.gate_up_proj, "path", quantization)  # a BF16Linear has none
print("DONE", json.dumps({"path": path, "tokens": tokens}), flush=True)
"""


def _kernels_built_while_serving(warmup: str, *draft: str, ours: bool = True) -> tuple[int, dict]:
    """(oneDNN kernels built while serving, the probe's answer); ``ours`` False: a bf16 model's own kernels off
    (AMX tiles, bf16 dot products), so that oneDNN multiplies every row count past the C kernels'."""
    off = {} if ours else {"PDSERVE_AMX_OFF": "1", "PDSERVE_DP_OFF": "1"}
    env = {**os.environ, "ONEDNN_VERBOSE": "all", "OMP_NUM_THREADS": "1", **off}
    out = subprocess.run([sys.executable, "-c", _PROBE, warmup, *draft], capture_output=True, text=True, env=env,
                         check=True, timeout=300)
    lines = out.stdout.splitlines()
    serving = lines[lines.index("SERVING"):]
    done = next(line for line in serving if line.startswith("DONE "))
    built = sum(1 for line in serving if "create:cache_miss" in line and "inner_product" in line)
    return built, json.loads(done.split(" ", 1)[1])


def test_after_the_warm_up_no_step_builds_a_projection_kernel_and_the_tokens_are_the_same():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    cold, without = _kernels_built_while_serving("off")
    if without["path"] != "onednn":
        pytest.skip(f"projections take the {without['path']} path on this processor: no oneDNN kernels")
    assert cold > 0  # without it, steps of new sizes build kernels while serving
    warm, with_it = _kernels_built_while_serving("on")
    assert warm == 0
    assert with_it["tokens"] == without["tokens"] and len(with_it["tokens"]) == 8


def test_a_draft_model_of_other_shapes_is_warmed_up_too_and_catches_up_within_the_budget(tmp_path):
    """Speculative decoding by a draft model: its projections (other shapes than the target's) are
    warmed up as well, and its catch-up over a 300-token prompt runs in passes of at most the 256-token
    budget, so no pass brings a row count the warm-up did not build (one pass of 301 rows did)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    shape = tmp_path / "draft.json"  # the tiny preset's vocabulary, other widths
    shape.write_text(json.dumps({"vocab_size": 49152, "hidden_size": 96, "intermediate_size": 160,
                                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}))
    cold, without = _kernels_built_while_serving("off", str(shape))
    if without["path"] != "onednn":
        pytest.skip(f"projections take the {without['path']} path on this processor: no oneDNN kernels")
    assert cold > 0
    warm, with_it = _kernels_built_while_serving("on", str(shape))
    assert warm == 0
    _, plain = _kernels_built_while_serving("off")  # greedy: the draft changes no token
    assert with_it["tokens"] == without["tokens"] == plain["tokens"] and len(with_it["tokens"]) == 8


def test_bfloat16_weights_are_warmed_up_too_and_no_step_builds_a_kernel():
    """``--quantization bf16``: its projections (``BF16Linear``, oneDNN's bfloat16 kernels) are warmed up
    as the float32 ones: each row count up to ``EXACT_ROWS``, the buckets above it. Before, every step
    size a server met built a kernel while serving, and the process grew by ~0.7 MiB a shape each time.
    Without our kernels (``PDSERVE_AMX_OFF=1``, ``PDSERVE_DP_OFF=1``: oneDNN takes every row count past the C
    kernels') and with them (AMX tiles or bf16 dot products take the rows up to each shape's measured
    ``amx_rows`` or ``dp_rows``, oneDNN the rest, if any)."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bfloat16 matmuls on this processor")
    cold, without = _kernels_built_while_serving("off", "quantization=bf16", ours=False)
    assert cold > 0
    warm, with_it = _kernels_built_while_serving("on", "quantization=bf16", ours=False)
    assert warm == 0
    assert with_it["tokens"] == without["tokens"] and len(with_it["tokens"]) == 8
    warm, on_tiles = _kernels_built_while_serving("on", "quantization=bf16")
    assert warm == 0 and len(on_tiles["tokens"]) == 8


def test_the_warm_up_covers_every_bucket_above_the_c_kernels_rows_and_the_head_up_to_its_rows():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    torch.manual_seed(0)
    body, head = Linear(32, 48), Linear(32, 100)
    for layer in (body, head):
        torch.nn.init.normal_(layer.weight)
        layer.prepare_for_cpu(1, None, "onednn", rows=8)
    model = torch.nn.Module()
    model.body, model.twin, model.lm_head = body, Linear(32, 48), head
    model.twin.weight = body.weight  # one shape: warmed once
    model.twin.prepare_for_cpu(1, None, "onednn", rows=8)
    seen = []
    for layer in (body, model.twin, head):
        layer.register_forward_hook(lambda mod, args, out: seen.append((mod.weight.shape[0], args[0].shape[0])))
    assert warm_up_projections(model, max_rows=100, head_rows=40) == (2, 7 + 3)
    assert sorted(rows for out, rows in seen if out == 48) == [16, 32, 48, 64, 80, 96, 112]
    assert sorted(rows for out, rows in seen if out == 100) == [16, 32, 48]


def test_unset_it_follows_the_environment_and_a_setting_wins(monkeypatch):
    monkeypatch.delenv("PDSERVE_WARMUP", raising=False)
    assert warmup_wanted(EngineConfig(model="random:tiny"))
    monkeypatch.setenv("PDSERVE_WARMUP", "0")
    assert not warmup_wanted(EngineConfig(model="random:tiny"))
    assert warmup_wanted(EngineConfig(model="random:tiny", warmup=True))
    monkeypatch.setenv("PDSERVE_WARMUP", "1")
    assert not warmup_wanted(EngineConfig(model="random:tiny", warmup=False))
