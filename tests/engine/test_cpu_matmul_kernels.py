"""The C few-rows matmul (csrc/cpu_kernels.c ``gemm_rows``: register tiles of 4 rows of W by up to 4
rows of x) against a float64 product, for every row count a projection sends it, float32 and
bfloat16 weights, sizes that are not multiples of the tile or the vector; and the row threshold each
machine measures (cpu_measured)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import cpu_kernels, cpu_measured
from pdserve.engine.cpu_kernels import load_kernels
from pdserve.engine.model import Linear

needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="no C compiler here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, 14))
def test_few_rows_products_equal_a_float64_matmul(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 131, generator=gen).to(dtype).contiguous()
    x = torch.randn(rows, 131, generator=gen)
    out = cpu_kernels.gemm_rows(load_kernels(), weight, x)
    expected = (x.double() @ weight.double().T).float()
    assert out.shape == (rows, 37)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    for r in range(rows):  # each row bit for bit as it would be alone (a request's decode in any batch)
        alone = cpu_kernels.gemm_rows(load_kernels(), weight, x[r : r + 1].contiguous())
        assert torch.equal(out[r : r + 1], alone)


@needs_kernels
def test_the_row_threshold_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch, caplog):
    """The first model on a machine times its layer both ways and writes the answer; the next reads it,
    so every worker on the machine multiplies a batch of a given size the same way."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    layer = []
    for n, k in ((48, 64), (96, 48)):
        linear = Linear(k, n)
        torch.nn.init.normal_(linear.weight)
        linear.prepare_for_cpu(1, load_kernels(), "onednn")
        layer.append(linear)
    rows, seconds = cpu_measured.measure(layer)
    assert set(seconds) == set(cpu_measured.CANDIDATES) and all(c > 0 and p > 0 for c, p in seconds.values())
    faster = [r for r in cpu_measured.CANDIDATES if seconds[r][0] <= seconds[r][1]]
    assert rows == 1 or rows in faster and all(r in faster for r in cpu_measured.CANDIDATES if r <= rows)
    first = cpu_measured.few_rows_for(layer, 1)
    assert (tmp_path / "measured.json").exists()
    monkeypatch.setattr(cpu_measured, "measure", lambda layer: pytest.fail("measured twice"))
    assert cpu_measured.few_rows_for(layer, 1) == first


@needs_kernels
def test_bf16_weights_measure_their_own_threshold_and_the_model_sets_it(tmp_path, monkeypatch):
    """A bf16 model's projections (``BF16Linear``) are timed apart from float32 ones, under a key of
    their own (``onednn bf16``), and ``choose_few_rows`` gives every bf16 projection that answer (and,
    with AMX tiles, each layer projection its shape's measured AMX rows; with bf16 dot products and no
    tiles, no widening rows at all and each shape, the head's too, its measured dot-product rows, at least
    ``DP_ROWS``)."""
    from pdserve.engine.config import PRESETS
    from pdserve.engine.cpu_kernels import AMX_ROWS
    from pdserve.engine.model import LlamaForCausalLM
    from pdserve.engine.quant import quantize_model
    from pdserve.engine.quant.formats import BF16Linear

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 here")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = LlamaForCausalLM(PRESETS["tiny"])
    quantize_model(model, "bf16")
    model.prepare_for_cpu(1, "onednn")
    layer = [m for m in model.layers[0].modules() if isinstance(m, BF16Linear)]
    amx = layer[0].amx is not None  # (AMX tiles: they take the rows up to AMX_ROWS past the C kernel)
    dp = layer[0].dp is not None  # (bf16 dot products without tiles: they take the rows from the first)
    assert not (amx and dp) and all((m.dp is not None) == dp for m in model.modules() if isinstance(m, BF16Linear))
    assert layer and layer[0].path.endswith("onednn bf16") and ("amx" in layer[0].path) == amx
    assert layer[0].few_rows == (0 if dp else BF16Linear.FEW_ROWS)
    if not dp:
        rows, seconds = cpu_measured.measure(layer)  # the C kernel against oneDNN, both in bfloat16 weights
        assert set(seconds) == set(cpu_measured.CANDIDATES) and all(c > 0 and p > 0 for c, p in seconds.values())
    monkeypatch.setattr(cpu_measured, "measure", lambda layer: (12, {12: (1.0, 2.0)}))
    monkeypatch.setattr(cpu_measured, "measure_amx_rows", lambda module, candidates: (256, {256: (1.0, 2.0)}))
    monkeypatch.setattr(cpu_measured, "measure_swiglu_rows", lambda module, candidates: (64, {64: (1.0, 2.0)}))
    dp_rows = {}  # each shape's answer, measured once
    monkeypatch.setattr(cpu_measured, "measure_dp_rows", lambda module, candidates: (
        dp_rows.setdefault((module.out_features, module.in_features), 16 * len(dp_rows)), {64: (1.0, 2.0)}))
    model.choose_few_rows(1)
    assert {m.few_rows for m in model.modules() if isinstance(m, BF16Linear)} == ({0} if dp else {12})
    # the layers' projections take the measured AMX rows (with tiles), any other (the head) AMX_ROWS
    in_layers = {id(m) for m in model.layers.modules()}
    for m in model.modules():
        if isinstance(m, BF16Linear):
            most = (256 if id(m) in in_layers else AMX_ROWS) if amx else 12
            most = max(BF16Linear.DP_ROWS, dp_rows[(m.out_features, m.in_features)]) if dp else most
            assert m.onednn_rows == most + 1 and (m.dp_rows == most) == dp
    assert len(dp_rows) == (len({(m.out_features, m.in_features) for m in model.modules()
                                 if isinstance(m, BF16Linear)}) if dp else 0)
    gate_ups = {id(layer.mlp.gate_up_proj) for layer in model.layers}  # and SwiGLU fused up to 64 rows
    assert {m.swiglu_rows for m in model.modules() if isinstance(m, BF16Linear)} == (
        {None, 64} if amx else {None}) and all(m.swiglu_rows == (64 if amx else None)
                                                for m in model.modules() if id(m) in gate_ups)
    x = torch.randn(12, layer[0].in_features)
    if dp:  # 12 rows through the dot products
        want = cpu_kernels.dp_gemm(load_kernels(), layer[0].dp, layer[0].out_features, x, torch.float32)
        assert torch.equal(layer[0](x), want)
    else:
        assert torch.equal(layer[0](x), layer[0].c_rows(x))  # 12 rows now through the C kernel


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 25, 70])
def test_bf16_dot_products_round_as_onednn_and_each_row_alone(rows):
    """``dp_gemm`` (csrc/cpu_dpbf16.c, bf16 dot products over the tiles' layout): x rounded to bfloat16, the
    products summed in float32 and rounded to bfloat16 (within one bfloat16 step of a float64 product of the
    rounded operands, as oneDNN's bf16 matmul is), float32 or bfloat16 x and out alike, and each row bit for bit
    as it would be alone (a request's decode in any batch)."""
    lib = load_kernels()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=gen).to(torch.bfloat16)
    packed = cpu_kernels.dp_pack(lib, weight)
    if packed is None:
        pytest.skip("built without bf16 dot products here")
    assert cpu_kernels.dp_pack(lib, weight[:, :150].contiguous()) is None  # (K not a multiple of 32)
    x = torch.randn(rows, 160, generator=gen)
    exact = x.to(torch.bfloat16).double() @ weight.double().T
    out = cpu_kernels.dp_gemm(lib, packed, 96, x, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    assert torch.equal(out, out.to(torch.bfloat16).float())  # (bfloat16 values)
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    half = cpu_kernels.dp_gemm(lib, packed, 96, x.to(torch.bfloat16), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), out)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        from pdserve.engine.model import onednn_linear

        theirs = onednn_linear(x.to(torch.bfloat16), torch.ops.mkldnn._reorder_linear_weight(weight, None),
                               lambda r: r).float()
        assert ((out - theirs).abs() <= theirs.abs() * 2**-7 + 1e-6).all()  # (one rounding step apart at most)
    for r in range(rows):
        alone = cpu_kernels.dp_gemm(lib, packed, 96, x[r : r + 1].contiguous(), torch.float32)
        assert torch.equal(out[r : r + 1], alone)


@needs_kernels
def test_a_broken_row_threshold_cache_is_measured_around_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / "measured.json").write_text("{not json")
    linear = Linear(64, 48)
    torch.nn.init.normal_(linear.weight)
    linear.prepare_for_cpu(1, load_kernels(), "onednn")
    monkeypatch.setattr(cpu_measured, "measure", lambda layer: (8, {8: (1.0, 2.0)}))
    assert cpu_measured.few_rows_for([linear], 1) == 8


@needs_kernels
def test_a_threshold_measured_under_load_is_kept_provisionally(tmp_path, monkeypatch):
    """Measured while other processes kept the cores busy: the processes starting with it read the same
    answer (workers that exchange KV must multiply alike), and once PROVISIONAL_S has passed the next
    process measures again; a quiet measurement is kept for good."""
    import json

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    linear = Linear(64, 48)
    torch.nn.init.normal_(linear.weight)
    linear.prepare_for_cpu(1, load_kernels(), "onednn")
    load = {"cores": 1.5}
    monkeypatch.setattr(cpu_measured, "others_load", lambda fn: (fn(), load["cores"]))
    answers = iter([(1, {1: (2.0, 1.0)}), (12, {12: (1.0, 2.0)})])
    monkeypatch.setattr(cpu_measured, "measure", lambda layer: next(answers))
    assert cpu_measured.few_rows_for([linear], 1) == 1
    (entry,) = json.loads((tmp_path / "measured.json").read_text()).values()
    assert entry["answer"] == 1 and entry["busy_cores"] == 1.5
    assert cpu_measured.few_rows_for([linear], 1) == 1  # a sibling starting alongside: the same answer

    monkeypatch.setattr(cpu_measured, "PROVISIONAL_S", 0.0)
    load["cores"] = 0.0
    assert cpu_measured.few_rows_for([linear], 1) == 12  # measured again, quietly: kept for good
    assert list(json.loads((tmp_path / "measured.json").read_text()).values()) == [12]
    monkeypatch.setattr(cpu_measured, "measure", lambda layer: pytest.fail("measured a third time"))
    assert cpu_measured.few_rows_for([linear], 1) == 12


def test_others_load_counts_other_processes_not_this_one():
    """A busy loop in this process is not others' load; a busy child process is."""
    import subprocess
    import sys
    import time

    def spin(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    _, mine = cpu_measured.others_load(lambda: spin(0.5))
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _, theirs = cpu_measured.others_load(lambda: time.sleep(0.5))
    finally:
        child.kill()
        child.wait()
    assert theirs > mine and theirs > 0.5
