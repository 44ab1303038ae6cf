"""The instruction set the engine computes with: chosen from the processor's flags, capped on
request (refused above the processor's), applied to oneDNN, MKL, ATen and the C kernels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.configs import ConfigError
from pdserve.engine.cpu_isa import ISA_FLAGS, best_isa, cpu_flags, select_isa
from pdserve.engine.cpu_kernels import AMX_ROWS
from pdserve.engine.quant.formats import BF16Linear

ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma"})
ZEN5 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}


def test_the_best_isa_of_a_processor():
    assert best_isa(frozenset()) == "baseline"
    assert best_isa(ZEN3) == "avx2"
    assert best_isa(ZEN5) == "avx512_bf16"
    assert best_isa(ZEN5 | {"amx_tile", "amx_bf16"}) == "amx"
    assert best_isa(ZEN5 - {"avx512_bf16"}) == "avx512"


def test_auto_takes_the_processors_best_and_a_cap_below_it_is_kept():
    plan = select_isa("auto", ZEN5)
    assert (plan.isa, plan.bf16_dot) == ("avx512_bf16", True)
    assert "the processor's best" in plan.describe()
    assert f"from one row up to {BF16Linear.DP_ROWS}," in plan.describe()  # the constant the layers use
    assert f"up to {AMX_ROWS} rows" in select_isa("auto", ZEN5 | {"amx_tile", "amx_bf16"}).describe()
    capped = select_isa("avx2", ZEN5)
    assert (capped.isa, capped.native, capped.bf16_dot) == ("avx2", "avx512_bf16", False)
    assert "--cpu-isa avx2" in capped.describe() and "emulated" in capped.describe()


def test_an_isa_the_processor_lacks_is_refused_naming_what_is_missing():
    with pytest.raises(ConfigError, match="cpu_isa: avx512 needs avx512f, avx512bw, avx512vl.*its best: avx2"):
        select_isa("avx512", ZEN3)
    with pytest.raises(ConfigError, match="cpu_isa: 'sse9' is not one of"):
        select_isa("sse9", ZEN3)


_PROBE = """
import json, os, sys
from pdserve.engine import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig(model="random:tiny", cpu_isa=sys.argv[1], num_kv_blocks=16, load_progress=False))
import torch
from pdserve.engine import cpu_kernels
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                  "isa": engine.cpu_plan.isa, "kernel_flags": cpu_kernels._cpu_flags(),
                  "path": engine.loaded.model.layers[0].mlp.gate_up_proj.path}))
"""


@pytest.mark.slow
def test_a_cap_reaches_every_library_in_a_fresh_process():
    native = best_isa(cpu_flags())
    if native not in ISA_FLAGS or native in ("baseline", "avx2"):
        pytest.skip(f"this processor's best is {native}: nothing above avx2 to cap")
    out = subprocess.run([sys.executable, "-c", _PROBE, "avx2"], capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["isa"] == "avx2" and probe["aten"] == "AVX2" and probe["onednn"] == "AVX2"
    assert not any("avx512" in f for f in probe["kernel_flags"])
    assert probe["path"] == "onednn"


def test_the_onednn_path_pads_rows_to_its_buckets_and_each_row_is_bitwise_the_unpadded_one(monkeypatch):
    """``model.Linear`` on the oneDNN path pads a step's rows up to ``ROW_BUCKET`` (oneDNN keeps a primitive
    per shape: unpadded, memory grows with every row count a server sees). Padding changes no output bit."""
    import torch

    from pdserve.engine.model import Linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    torch.manual_seed(0)
    layer = Linear(96, 80)
    torch.nn.init.normal_(layer.weight)
    layer.prepare_for_cpu(1, None, "onednn")
    real = torch.ops.mkldnn._linear_pointwise
    given = []  # the row counts oneDNN was given

    def recording(x, *args):
        given.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    for rows in (5, 15, 16, 17, 40, 130, 600, 1100):
        x = torch.randn(rows, 96)
        y = layer(x)
        assert y.shape == (rows, 80) and y.is_contiguous()
        assert torch.equal(y, real(x, layer.packed_weight(), None, "none", [], ""))
        assert torch.allclose(y, x @ layer.weight.T, rtol=1e-4, atol=1e-4)
    assert given == [16, 16, 16, 32, 48, 144, 608, 1152]  # from 1,024 rows buckets widen: 64, then 128


def test_bfloat16_weights_keep_small_row_counts_exact_and_pad_larger_ones_to_the_buckets(monkeypatch):
    """``BF16Linear`` (``--quantization bf16``) gives oneDNN each row count up to ``EXACT_ROWS`` as it is (a
    decode batch: padding 5 rows to 16 cost a fifth of a step) and larger ones padded to ``Linear``'s
    buckets, so a server builds a bounded set of kernels; padding changes no output bit."""
    import torch

    from pdserve.engine.model import Linear
    from pdserve.engine.quant.formats import BF16Linear

    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bfloat16 matmuls on this processor")
    torch.manual_seed(0)
    layer = BF16Linear(torch.randn(80, 96))
    real, given = torch.ops.mkldnn._linear_pointwise, []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: (given.append(x.shape[0]), real(x, *a))[1])
    for rows in (5, 17, 32, 33, 48, 130, 600):
        x = torch.randn(rows, 96)
        y = layer(x)
        assert y.shape == (rows, 80) and y.dtype == torch.float32 and y.is_contiguous()
        unpadded = real(x.to(torch.bfloat16), layer.packed, None, "none", [], "").float()
        assert torch.equal(y, unpadded)
        assert torch.allclose(y, x @ layer.qweight.float().T, rtol=2e-2, atol=2e-1)
    assert given == [5, 17, 32, 48, 48, 144, 608]
    assert BF16Linear.EXACT_ROWS <= Linear.WARM_MAX_ROWS


def test_the_warm_up_builds_the_bucket_of_every_row_count_a_step_can_bring(monkeypatch):
    """Every row count from the C kernel's last to the token budget (at most ``WARM_MAX_ROWS``) lands in
    a bucket the warm-up ran, no bucket twice, and at most 1/16 of a padded step is padding."""
    import torch

    from pdserve.engine.model import Linear, warm_up_projections

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    budget = 2048
    assert all(r <= Linear.padded_rows(r) <= max(r + 15, r * 17 // 16) for r in range(1, 3 * budget))
    model = torch.nn.Sequential(Linear(8, 4))
    model[0].prepare_for_cpu(1, None, "onednn", rows=3)
    real, given = torch.ops.mkldnn._linear_pointwise, []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: (given.append(x.shape[0]), real(x, *a))[1])
    shapes, calls = warm_up_projections(model, budget, 64)
    assert (shapes, calls) == (1, len(given)) and len(set(given)) == len(given)
    assert {Linear.padded_rows(r) for r in range(4, Linear.WARM_MAX_ROWS + 1)} == set(given)
    assert len(given) == 32  # of 16 rows up to 512 (the 48 larger ones up to 2,048: built by their first step)
    assert len({Linear.padded_rows(r) for r in range(4, budget + 1)}) == 80  # 64 of 16 up to 1,024, 16 of 64
