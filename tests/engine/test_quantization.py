"""Weight-only quantization: each format against float, config refusals, whole models.

Relative errors are ``|y_q - y| / |y|`` (Frobenius) on random Gaussian weights; the bounds
leave ~1.5x room over what was measured on the development machines.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.configs import ConfigError, from_dict
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.attention import PREFILL_PRODUCTS
from pdserve.engine.cpu_isa import int8_dot as cpu_isa_int8_dot
from pdserve.engine.cpu_kernels import load_kernels
from pdserve.engine.loader import load_model
from pdserve.engine.model import MLP, Attention, RMSNorm, onednn_linear
from pdserve.engine.quant import QuantLinear, quantize_model, weight_bytes
from pdserve.engine.quant.awq import full_forward, search_scale, smooth_scale
from pdserve.engine.quant.formats import (
    QLINEAR_WEIGHT_LEVELS,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    dequantize_fp8,
    int4_group_size,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from pdserve.engine.quant.gguf_native import GGUFLinear
from tests.conftest import assert_no_leaks, run_to_completion


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture
def weight_and_input():
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 384, generator=g) * 0.02, torch.randn(8, 384, generator=g)


# ---- single layers ------------------------------------------------------------------------


def test_int8_linear_close_to_float(weight_and_input):
    w, x = weight_and_input
    layer = Int8Linear(w)
    assert layer.qweight.dtype == torch.int8 and layer.weight_bytes() < w.numel() * 4 / 3.5
    assert rel_err(layer(x), F.linear(x, w)) < 0.015
    assert rel_err(layer.dequantize(), w) < 0.015
    assert layer(x).dtype == torch.float32 and layer(x[:1]).shape == (1, 256)


@pytest.fixture(params=["int_mm", "qlinear"])
def w8a8_kernel(request, monkeypatch):
    """W8A8Linear through each int8 kernel that is exact here (torch._int_mm is slow without VNNI, but
    exact unless oneDNN saturates): the arithmetic is checked on every processor."""
    from pdserve.engine.quant import formats

    exact = formats.int_mm_exact(torch.device("cpu")) if request.param == "int_mm" else formats.qlinear_exact()
    if not exact:
        pytest.skip(f"{request.param} is not exact on this processor")
    monkeypatch.setattr(formats, "_INT8_MATMULS", {"cpu": request.param})
    return request.param


def test_w8a8_many_rows_multiply_int8_activations_exactly_as_their_integers_do(weight_and_input, w8a8_kernel):
    """From MANY_ROWS rows each row of x is rounded to int8 with its own scale and the int32 sums are
    scaled back: the same as multiplying the two dequantised tensors in float64 (the weight's copy at
    8 bits for _int_mm, 7 for oneDNN's qlinear); fewer rows are Int8Linear's products."""
    w, _ = weight_and_input
    x = torch.randn(W8A8Linear.MANY_ROWS + 5, 384, generator=torch.Generator().manual_seed(1))
    x[3] *= 50  # a row of outliers keeps its own scale
    layer = W8A8Linear(w)
    assert layer.kernel == w8a8_kernel
    xq, xs = quantize_int8(x)
    wq, ws = quantize_int8(w, 127 if w8a8_kernel == "int_mm" else QLINEAR_WEIGHT_LEVELS)
    want = (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], 256)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert rel_err(got, F.linear(x, w)) < (0.02 if w8a8_kernel == "int_mm" else 0.03)
    few = x[: W8A8Linear.MANY_ROWS - 1]
    int8 = Int8Linear(w)
    assert torch.equal(layer(few), int8(few))
    assert layer(x.reshape(1, *x.shape)).shape == (1, x.shape[0], 256)


def test_w8a8_without_an_exact_int8_matmul_keeps_one_weight_and_the_weight_only_products(weight_and_input,
                                                                                      monkeypatch):
    """No exact int8 kernel: every row count takes Int8Linear's products, no second copy of the weight."""
    from pdserve.engine.quant import formats

    monkeypatch.setattr(formats, "_INT8_MATMULS", {"cpu": None})
    w, _ = weight_and_input
    x = torch.randn(64, 384, generator=torch.Generator().manual_seed(2))
    layer = W8A8Linear(w)
    assert layer.kernel is None and layer.mm_weight is None
    assert torch.equal(layer(x), Int8Linear(w)(x))


def test_w8a8_kernel_choice_follows_the_processor(monkeypatch):
    """VNNI: _int_mm; AVX2 without it: oneDNN's qlinear (torch's _int_mm is ~3 GOP/s there); below
    AVX2 (--cpu-isa baseline): none. Each choice made once per device kind."""
    from pdserve.engine import cpu_isa
    from pdserve.engine.quant import formats

    for vnni, isa, want in ((True, "avx512", "int_mm"), (False, "avx2", "qlinear"), (False, "baseline", None)):
        monkeypatch.setattr(formats, "_INT8_MATMULS", {})
        monkeypatch.setattr(cpu_isa, "int8_dot", lambda vnni=vnni: vnni)
        monkeypatch.setenv("PDSERVE_CPU_ISA", isa)
        monkeypatch.setattr(formats, "int_mm_exact", lambda device: True)
        monkeypatch.setattr(formats, "qlinear_exact", lambda: True)
        assert formats.int8_matmuls(torch.device("cpu")) == want
        assert formats._INT8_MATMULS == {"cpu": want}
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")  # what the engine sets for --cpu-isa avx2
    assert not cpu_isa.int8_dot()


@pytest.mark.skipif(cpu_isa_int8_dot(), reason="VNNI's vpdpbusd adds byte products without saturating")
def test_qlinear_saturates_with_8_bit_weights_and_is_exact_with_7():
    """Without VNNI oneDNN's qlinear pairs unsigned-times-signed byte products in a saturating int16:
    why W8A8Linear rounds its copy of the weight to 7 bits for it."""
    from pdserve.engine.quant.formats import _qlinear, qlinear_exact

    x = torch.full((32, 256), 127, dtype=torch.int8)  # 255 as the kernel's unsigned bytes
    w8 = torch.full((64, 256), 127, dtype=torch.int8)
    got = _qlinear(x, torch.ops.onednn.qlinear_prepack(w8, None), torch.ones(64), torch.zeros(64, dtype=torch.int64))
    assert not torch.equal(got.double(), torch.full((32, 64), 127.0 * 127 * 256, dtype=torch.float64))
    assert qlinear_exact()


@pytest.mark.skipif(not cpu_isa_int8_dot(), reason="no AVX-512 VNNI here: nothing for oneDNN to saturate")
def test_int8_matmul_exactness_probe_fails_on_saturating_kernels():
    """The probe runs torch._int_mm on bytes at int8's ends; capped at AVX2, oneDNN pairs products in a
    saturating int16, the probe says so and the layers take oneDNN's qlinear with 7-bit weights (a
    child process: the cap is read when oneDNN starts)."""
    code = ("import torch; from pdserve.engine.quant.formats import int_mm_exact, int8_matmuls; "
            "print(int_mm_exact(torch.device('cpu')), int8_matmuls(torch.device('cpu')))")
    capped = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
                            capture_output=True, text=True, check=True)
    assert capped.stdout.split() == ["False", "qlinear"]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64])
def test_bf16_linear_close_to_float_through_each_path(weight_and_input, rows):
    """1-4 rows through the C kernels (float32 arithmetic on bf16 weights), more through oneDNN; where bf16 dot
    products take the rows from the first (no AMX tiles), every row count rounds x to bfloat16."""
    from pdserve.engine.quant.formats import BF16Linear

    w, x = weight_and_input
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    layer = BF16Linear(w)
    assert layer.qweight.dtype == torch.bfloat16 and layer.weight_bytes() == w.numel() * 2
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, w.shape[0])
    assert rel_err(got, F.linear(x, layer.dequantize())) < (1e-5 if rows <= layer.few_rows else 0.02)
    assert rel_err(got, F.linear(x, w)) < 0.02


def test_bf16_linear_on_amx_tiles_multiplies_as_onednn_does():
    """Where the processor has AMX tiles, a bf16 layer's rows past the C kernels and up to its
    ``amx_rows`` (AMX_ROWS unless the model measured more) go through our tile kernels (up to
    AMX_ROWS the decode one, past it the prefill one, rows in place or padded past the last 32): the
    same bfloat16 products as oneDNN's, summed in float32 (in another order) and rounded to bfloat16
    as oneDNN's answer is, float32 or bfloat16 x in, float32 or bfloat16 out; more rows go to oneDNN."""
    from pdserve.engine import cpu_kernels
    from pdserve.engine.quant.formats import BF16Linear

    gen = torch.Generator().manual_seed(7)
    layer = BF16Linear(torch.randn(96, 160, generator=gen) * 0.05)
    if layer.amx is None:
        pytest.skip("no AMX tiles here (or the ISA is capped below them)")
    assert "amx" in layer.path and layer.onednn_rows == cpu_kernels.AMX_ROWS + 1
    for amx_rows in (None, 300):
        layer.amx_rows = amx_rows
        most = amx_rows or cpu_kernels.AMX_ROWS
        assert f"amx bf16 to {most} rows" in layer.path and layer.onednn_rows == most + 1
        for rows in (1, 3, 16, 17, 40, cpu_kernels.AMX_ROWS, cpu_kernels.AMX_ROWS + 1, 96, 127, 300, 301):
            for x in (torch.randn(rows, 160, generator=gen), torch.randn(rows, 160, generator=gen).bfloat16()):
                want = onednn_linear(x.bfloat16(), layer.packed, layer.padded_rows)
                got = layer.many_rows(x)
                assert got.dtype == x.dtype
                torch.testing.assert_close(got.float(), want.float(), rtol=0.01, atol=1e-3)
                widened = layer._amx(x, torch.float32)
                if rows <= most:
                    reference = (x.bfloat16().double() @ layer.qweight.double().T).float()
                    torch.testing.assert_close(widened, reference, rtol=2**-8, atol=1e-6)  # within bfloat16's step
                    assert torch.equal(layer._amx(x, torch.bfloat16), widened.bfloat16())
                    assert torch.equal(widened.bfloat16().float(), widened)
                else:
                    assert widened is None  # (more rows than the tiles take)


def test_amx_rows_are_measured_per_shape_and_chosen_by_the_least_time(monkeypatch):
    """The model asks ``cpu_measured.amx_rows_for`` once per shape of its layers' bf16 projections;
    the threshold is the one whose choice (AMX up to it, oneDNN past it) costs least over the candidates,
    each counted as its time over oneDNN's (0: oneDNN past the decode kernel's rows)."""
    from pdserve.engine import cpu_measured
    from pdserve.engine.quant.formats import BF16Linear

    layer = BF16Linear(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 0.05)
    if layer.amx is None:
        pytest.skip("no AMX tiles here (or the ISA is capped below them)")
    times = iter([])

    def timed(fn):  # AMX then oneDNN for each candidate, every round: the scripted seconds
        fn()
        return next(times)

    monkeypatch.setattr(cpu_measured, "_timed", timed)
    monkeypatch.setattr(cpu_measured, "AMX_ROUNDS", 1)
    for script, want in (({128: (1, 2), 256: (1, 2), 512: (3, 2)}, 256),  # AMX leads to 256 rows
                         ({128: (1, 2), 256: (2.5, 2), 512: (1, 2)}, 512),  # one loss outweighed
                         ({128: (3, 2), 256: (3, 2), 512: (1, 2)}, 0)):  # oneDNN throughout, bar one
        times = iter([t for pair in script.values() for t in pair])
        rows, seconds = cpu_measured.measure_amx_rows(layer, tuple(script))
        assert rows == want and seconds == {r: (float(a), float(d)) for r, (a, d) in script.items()}


def test_bf16_linear_through_dot_products_up_to_its_rows_then_onednn():
    """Where the processor has bf16 dot products but no AMX tiles, a bf16 layer's rows from the first up to its
    ``dp_rows`` go through our vdpbf16ps kernel (``dp_gemm``; float32 or bfloat16 x in, float32 or bfloat16 out,
    ``product_bf16`` included), more through oneDNN, which rounds alike: within one bfloat16 step of it."""
    from pdserve.engine import cpu_kernels
    from pdserve.engine.model import onednn_linear
    from pdserve.engine.quant.formats import BF16Linear

    gen = torch.Generator().manual_seed(8)
    layer = BF16Linear(torch.randn(96, 160, generator=gen) * 0.05)
    if layer.dp is None or layer.packed is None:
        pytest.skip("no bf16 dot products here, or AMX tiles instead")
    assert layer.few_rows == 0 and "dot products" in layer.path and layer.onednn_rows == layer.dp_rows + 1
    layer.dp_rows = 8
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 160, generator=gen)
        ours = cpu_kernels.dp_gemm(layer.kernels, layer.dp, 96, x, torch.float32)
        theirs = onednn_linear(x.to(torch.bfloat16), layer.packed, layer.padded_rows).float()
        assert torch.equal(layer(x), ours if rows <= 8 else theirs), rows
        assert torch.equal(layer.product_bf16(x.to(torch.bfloat16)).float(), ours if rows <= 8 else theirs)
        assert ((ours - theirs).abs() <= theirs.abs() * 2**-7 + 1e-6).all()


def test_bf16_swiglu_stays_in_bfloat16_and_equals_the_widened_path():
    """Past the C kernels' rows a bf16 MLP hands gate_up's bfloat16 product to SwiGLU and the down
    projection as it is (``silu_mul_bf16``); the result is bit for bit the path that widens the product
    to float32, applies SwiGLU there and rounds it back (and a few rows still go through the C kernels)."""
    from pdserve.engine import cpu_kernels
    from pdserve.engine.config import PRESETS
    from pdserve.engine.model import MLP
    from pdserve.engine.quant.formats import BF16Linear

    lib = cpu_kernels.load_kernels()
    if lib is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("needs the C kernels and oneDNN's bfloat16")
    gen = torch.Generator().manual_seed(3)
    for n in (173, 176):  # a row's tail one by one; whole rows 16 lanes at a time (AVX-512)
        gate_up = torch.randn(37, 2 * n, generator=gen).to(torch.bfloat16) * 4
        gate_up[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])  # NaN; e^-g large, and tiny
        widened = cpu_kernels.silu_mul(lib, gate_up.float().contiguous()).to(torch.bfloat16)
        got = cpu_kernels.silu_mul(lib, gate_up)
        nan = widened.isnan()  # (a NaN's bits: the kernel's 0x7fc0, torch's vector cast 0xffff)
        assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), nan) and nan[0, 0]
        assert torch.equal(got[~nan].view(torch.int16), widened[~nan].view(torch.int16))
        gate, up = gate_up.float().split(n, dim=-1)
        torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2, equal_nan=True)

    cfg = PRESETS["tiny"]
    mlp = MLP(cfg)
    mlp.gate_up_proj = BF16Linear(torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, generator=gen) * 0.05)
    mlp.down_proj = BF16Linear(torch.randn(cfg.hidden_size, cfg.intermediate_size, generator=gen) * 0.05)
    mlp.kernels, mlp.bf16_swiglu = lib, True  # (as LlamaForCausalLM.prepare_for_cpu sets them)
    for rows in (3, 40):
        x = torch.randn(rows, cfg.hidden_size, generator=gen)
        h = cpu_kernels.silu_mul(lib, mlp.gate_up_proj(x))
        assert h.dtype == torch.float32
        assert torch.equal(mlp(x), mlp.down_proj(h)), rows
    # the C kernels' rows: float32 all through (none where bf16 dot products take every row)
    assert (mlp.gate_up_proj.product_bf16(x[:3]) is None) == (mlp.gate_up_proj.few_rows >= 3)


def test_bf16_swiglu_fused_into_the_amx_gate_up_equals_swiglu_after_it():
    """Where the processor has AMX tiles, a bf16 MLP's SwiGLU can be applied as gate_up's tiles are
    stored (``amx_swiglu``, up to the gate_up's measured ``swiglu_rows``): bit for bit ``silu_mul`` over
    the tiles' own bfloat16 product (every row count, tails past the last 32 rows, float32 or bfloat16
    x), NaN included, and the MLP's output equals the unfused path's where that product comes from the
    tiles too."""
    from pdserve.engine import cpu_kernels
    from pdserve.engine.config import PRESETS
    from pdserve.engine.model import MLP
    from pdserve.engine.quant.formats import BF16Linear

    lib = cpu_kernels.load_kernels()
    gen = torch.Generator().manual_seed(5)
    cfg = PRESETS["tiny"]
    gate_up = BF16Linear(torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, generator=gen) * 0.2)
    if lib is None or gate_up.amx is None:
        pytest.skip("no AMX tiles here (or the ISA is capped below them)")
    n = gate_up.out_features
    for rows in (1, 9, 31, 32, 33, 64, 65, 100, 300):
        for x in (torch.randn(rows, cfg.hidden_size, generator=gen) * 3,
                  (torch.randn(rows, cfg.hidden_size, generator=gen) * 3).bfloat16()):
            if rows == 9:
                x[0, 0] = float("nan")
            product = cpu_kernels.amx_gemm(lib, gate_up.amx, n, x.contiguous(), torch.bfloat16)
            want = cpu_kernels.silu_mul(lib, product)
            got = cpu_kernels.amx_swiglu(lib, gate_up.amx, n, x.contiguous())
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n // 2)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan) and nan.any() == (rows == 9)
            assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), rows

    mlp = MLP(cfg)
    mlp.gate_up_proj = gate_up
    mlp.down_proj = BF16Linear(torch.randn(cfg.hidden_size, cfg.intermediate_size, generator=gen) * 0.05)
    mlp.kernels, mlp.bf16_swiglu = lib, True  # (as LlamaForCausalLM.prepare_for_cpu sets them)
    gate_up.amx_rows = 4096  # the unfused product from the tiles as well
    for rows in (3, 40, 200):
        x = torch.randn(rows, cfg.hidden_size, generator=gen)
        gate_up.swiglu_rows = None
        apart = mlp(x)
        gate_up.swiglu_rows = 128
        fused = gate_up.swiglu_bf16(x)
        assert (fused is not None) == (gate_up.few_rows < rows <= 128)
        assert torch.equal(mlp(x), apart), rows


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_close_to_float(weight_and_input, group):
    w, x = weight_and_input
    layer = Int4Linear(w, group)
    bound = {32: 0.10, 64: 0.12, 128: 0.14}[group]
    assert rel_err(layer(x), F.linear(x, w)) < bound
    assert rel_err(layer.dequantize(), Int4Linear.fake_quant(w, group)) < 0.01  # the kernel uses the fake-quant weight
    assert layer.weight_bytes() < w.numel() * 4 / 6


def test_int4_many_rows_take_the_bf16_weight_from_the_kernels_layout():
    """A prefill-sized input (MANY_ROWS rows or more) multiplies by the weight unpacked from the CPU
    kernel's packed layout to bfloat16: the same weight as the kernel's, to bfloat16 rounding."""
    from pdserve.engine.quant.formats import CPU_PACK_ROWS, unpack_cpu_int4

    w = torch.randn(192, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    layer = Int4Linear(w, 64)
    if not layer.use_kernel:
        pytest.skip("no CPU int4 kernel in this torch build")
    q, _, _ = quantize_int4(w, 64, layer.act_dtype)
    assert layer.out_features % CPU_PACK_ROWS == 0
    if not torch.equal(unpack_cpu_int4(layer.qweight, 192, 256), q):  # the layout the layer would assume
        # torch packs for the processor it runs on (an AVX2-only one differently): the layer's check at
        # load must then keep every row count on the kernel
        assert not layer.dequant_many_rows
        pytest.skip("the CPU kernel packs this processor's weights in another layout: every row count takes it")
    if not layer.dequant_many_rows:
        pytest.skip("no bfloat16 matmul on this processor: every row count takes the kernel")
    assert rel_err(layer._bf16_weight().float(), layer.dequantize()) < 1e-2
    x = torch.randn(layer.MANY_ROWS + 3, 256, generator=torch.Generator().manual_seed(6))
    assert rel_err(layer(x), F.linear(x, layer.dequantize())) < 0.01
    few = x[: layer.MANY_ROWS - 1]
    assert rel_err(layer(few), F.linear(few, layer.dequantize())) < 0.01  # the kernel's path


def test_int4_math_and_group_fallback():
    w = torch.randn(64, 128)
    q, scale, zero = quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == (64, 4)
    assert int4_group_size(576, 128) == 64 and int4_group_size(1536, 128) == 128 and int4_group_size(40, 64) is None


def test_awq_beats_plain_int4_on_outlier_channels():
    """Activations with a few channels 20x larger (as LLM activations have): AWQ's scaled weights
    lose less of the output than plain int4."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * 0.02
    x = torch.randn(512, 512, generator=g)
    x[:, torch.randperm(512, generator=g)[:8]] *= 20.0
    plain = Int4Linear(w, 128)
    s = search_scale(w, x, 128)
    awq = Int4Linear(w * s, 128)
    awq.set_input_scale(1.0 / s)
    want = F.linear(x, w)
    e_plain, e_awq = rel_err(plain(x), want), rel_err(awq(x), want)
    assert e_awq <= e_plain
    assert e_awq < 0.8 * e_plain, (e_awq, e_plain)


def test_smoothquant_beats_plain_w8a8_on_outlier_channels(w8a8_kernel):
    """Activations with a few channels 30x larger: per-token int8 rounds the rest to a few levels;
    SmoothQuant's scales move the outliers into the weight's columns and lose less of the output."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * 0.02
    x = torch.randn(W8A8Linear.MANY_ROWS * 4, 512, generator=g)
    x[:, torch.randperm(512, generator=g)[:8]] *= 30.0
    plain = W8A8Linear(w)
    levels = 127 if w8a8_kernel == "int_mm" else QLINEAR_WEIGHT_LEVELS  # the weight's copy the kernel takes
    s = smooth_scale(w, x, weight_levels=levels)
    smooth = W8A8Linear(w * s)
    smooth.set_input_scale(1.0 / s)
    want = F.linear(x, w)
    e_plain, e_smooth = rel_err(plain(x), want), rel_err(smooth(x), want)
    assert e_smooth < 0.6 * e_plain, (e_smooth, e_plain)
    flat = torch.randn(64, 512, generator=g)  # the search never does worse than no scaling on what it saw
    s = smooth_scale(w, flat, weight_levels=levels)
    smooth = W8A8Linear(w * s)
    smooth.set_input_scale(1.0 / s)
    assert rel_err(smooth(flat), F.linear(flat, w)) <= rel_err(plain(flat), F.linear(flat, w)) * 1.0001


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_quantize_dequantize_math(weight_and_input, per_channel):
    w, x = weight_and_input
    q, scale = quantize_fp8(w, per_channel)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ((256, 1) if per_channel else ())
    assert float(q.float().abs().max()) <= 448.0
    back = dequantize_fp8(q, scale)
    assert rel_err(back, w) < 0.04  # e4m3: 3 mantissa bits
    xq, xs = quantize_fp8(x, per_channel)  # what Fp8Linear does to the activation before _scaled_mm
    assert rel_err(F.linear(dequantize_fp8(xq, xs), back), F.linear(x, w)) < 0.05


def test_fp8_refused_on_cpu():
    with pytest.raises(RuntimeError, match="fp8 needs a CUDA GPU"):
        Fp8Linear(torch.randn(32, 32))
    with pytest.raises(ConfigError, match="EngineConfig.quantization: fp8 needs a CUDA GPU with FP8 support"):
        load_model("random:tiny", progress=False, quantization="fp8")


# ---- configuration ------------------------------------------------------------------------


def test_config_names_the_key():
    assert EngineConfig().quantization == "none"
    with pytest.raises(ConfigError, match=r"EngineConfig\.quantization: 'int3' is not one of"):
        from_dict(EngineConfig, {"quantization": "int3"})
    with pytest.raises(ConfigError, match=r"EngineConfig\.quantization_group_size: 48 is not one of \[32, 64, 128\]"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    assert from_dict(EngineConfig, {"quantization": "awq", "quantization_group_size": 32}).quantization == "awq"


def test_gguf_refused_for_a_model_that_is_not_a_gguf_file():
    with pytest.raises(ConfigError, match="quantization: gguf keeps a GGUF file's quantized blocks.*'random'"):
        load_model("random:tiny", progress=False, quantization="gguf")


def test_gguf_blocks_dequantise_as_the_gguf_library_does():
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from pdserve.engine.quant.gguf_native import dequantize_blocks

    data = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16):
        blocks = quantize(data, qtype)
        got = dequantize_blocks(qtype, torch.from_numpy(blocks.view(np.uint8).copy()), 128)
        np.testing.assert_allclose(got.numpy(), dequantize(blocks, qtype), rtol=1e-6, atol=1e-6)


def fused_gguf_layer(rng, segments, cols: int = 96) -> GGUFLinear:
    """A fused projection of ``(GGML type, rows)`` segments of random weights, quantized by gguf."""
    from gguf.quants import quantize

    from pdserve.engine.quant.gguf_native import Segment

    out = []
    for qtype, n in segments:
        w = rng.standard_normal((n, cols)).astype(np.float32)
        out.append(Segment(qtype, torch.from_numpy(quantize(w, qtype).view(np.uint8).reshape(n, -1).copy()), n))
    return GGUFLinear(out, cols)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_gguf_blocks_multiply_through_the_c_kernels_as_their_dequantised_weight(rows):
    """A fused projection of Q8_0, Q4_0, Q4_1 and F16 segments (F16 has no kernel: dequantised),
    multiplied from its blocks for a few rows, equals x @ W^T of the dequantised weight, each segment
    writing its own columns."""
    from gguf import GGMLQuantizationType as Q

    from pdserve.engine import cpu_kernels

    lib = cpu_kernels.load_kernels()
    if lib is None:
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(rows)
    layer = fused_gguf_layer(rng, ((Q.Q4_1, 40), (Q.Q8_0, 24), (Q.F16, 8), (Q.Q4_0, 36)))
    layer.prepare_for_cpu(1, lib)
    x = torch.from_numpy(rng.standard_normal((rows, 96)).astype(np.float32))
    want = x @ layer.dequantize().T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    layer.prepare_for_cpu(1, None)  # no kernels: the dequantised path, the same product
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("linear_path", ["mkl", "onednn"])
def test_gguf_layers_get_the_c_kernels_whatever_the_float_path(linear_path):
    """The quantized layers are prepared after quantization on either float path (on "mkl" they
    were left without kernels: every decode step dequantised)."""
    from pdserve.engine import cpu_kernels

    if cpu_kernels.load_kernels() is None:
        pytest.skip("no C compiler here")
    if linear_path == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    model = load_model(progress=False, quantization="gguf", linear_path=linear_path).model
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(m.kernels is not None for m in layers)


def test_gguf_k_quant_and_q5_0_blocks_dequantise_bit_for_bit_as_the_gguf_library_does():
    """Gemma 3 270M's Q4_K_M file mixes Q5_0, Q4_K, Q6_K and Q8_0: random blocks (their f16 scales
    made finite) give exactly what gguf.quants gives, float32 bit for bit."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from pdserve.engine.quant.gguf_native import dequantize_blocks

    rng = np.random.default_rng(1)
    scale_bytes = {Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}  # where each block's f16 scales sit
    for qtype, offsets in scale_bytes.items():
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, cols = 6, 2 * 256
        blocks = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
        for at in offsets:
            blocks[:, at:at + 2] = rng.uniform(-0.1, 0.1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        want = dequantize(blocks, qtype).reshape(rows, cols)
        got = dequantize_blocks(qtype, torch.from_numpy(blocks.reshape(rows, -1).copy()), cols)
        assert np.array_equal(got.numpy(), want), qtype.name


# ---- whole models -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_tiny():
    return load_model("random:tiny", progress=False, seed=3)


@pytest.mark.parametrize("method,bound", [("int8", 0.015), ("w8a8_int8", 0.03), ("int4", 0.16), ("awq", 0.16),
                                          ("bf16", 0.015)])
def test_tiny_model_quantized_logits_close_to_float(float_tiny, method, bound):
    quant = load_model("random:tiny", progress=False, seed=3, quantization=method)
    layers = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * quant.config.num_layers + 1  # the output head too
    # (the tiny model is mostly its embedding, which the Q8_0 head adds to: compare the layers)
    assert weight_bytes(quant.model.layers) < weight_bytes(float_tiny.model.layers)
    assert quant.fingerprint != float_tiny.fingerprint  # quantized KV must not be mixed with float KV
    ids = torch.tensor(float_tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4))
    want, got = full_forward(float_tiny.model, ids), full_forward(quant.model, ids)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < bound


def test_a_bf16_model_between_norms_and_projections_stays_in_bfloat16_with_the_same_logits(float_tiny):
    """bf16 weights past the C kernels' rows: the norms hand each projection bfloat16 and take its
    bfloat16 product back (DecoderLayer.bf16_norms), and RoPE widens the qkv product as it rotates;
    the logits are bit for bit those of float32 norms with casts around them, and the rotation is
    model.apply_rope's (the C kernels off: torch's ops throughout)."""
    quant = load_model("random:tiny", progress=False, seed=3, quantization="bf16")
    model = quant.model
    if model.layers[0].self_attn.kernels is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("needs the C kernels and oneDNN's bfloat16")
    assert all(layer.bf16_norms and layer.self_attn.bf16_qkv for layer in model.layers)
    ids = torch.tensor(float_tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4))
    assert len(ids) > model.layers[0].self_attn.qkv_proj.few_rows
    seen = []  # the dtype the MLP's norm hands its projection
    hook = model.layers[1].post_attention_layernorm.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
    with torch.inference_mode():
        narrow = full_forward(model, ids)
        for layer in model.layers:
            layer.bf16_norms = False
        wide = full_forward(model, ids)
        for module in model.modules():
            if isinstance(module, (RMSNorm, MLP, Attention)):
                module.kernels = None
            if isinstance(module, (MLP, Attention)):
                module.bf16_swiglu = module.bf16_qkv = False
        torch_ops = full_forward(model, ids)
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(narrow, wide)
    torch.testing.assert_close(narrow, torch_ops, rtol=1e-4, atol=1e-4)


def test_a_bf16_models_attention_writes_its_output_in_bfloat16_for_the_o_projection(make_engine, monkeypatch):
    """bf16 weights, a step with a prompt chunk past the C kernels' rows: attention writes its output in
    bfloat16 (Attention.bf16_out; the decode rows and, on this tiny model's heads, SDPA's chunk copied in,
    the C kernel's rounded as ``.to`` rounds: test_cpu_attention_kernels), which o_proj's bfloat16 product
    reads as it is; every logprob (the prompts', the decodes' beside them) bit for bit what a float32
    output rounded by o_proj gives."""
    from pdserve.engine.attention import TorchPagedAttention
    from pdserve.engine.sampling_params import SamplingParams

    engine = make_engine(loaded=load_model("random:tiny", progress=False, seed=3, quantization="bf16"),
                         quantization="bf16", kv_cache_dtype="bfloat16", max_num_batched_tokens=128)
    attns = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
    if not all(a.bf16_out for a in attns) or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("needs the C kernels and oneDNN's bfloat16")
    asked = []
    forward = TorchPagedAttention.forward
    monkeypatch.setattr(TorchPagedAttention, "forward",
                        lambda self, *a, **kw: asked.append(kw.get("out_dtype")) or forward(self, *a, **kw))
    def run(bf16_out: bool) -> list:
        for a in attns:
            a.bf16_out = bf16_out
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
        prompts = [torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (40, 70, 100)]
        seen = []
        engine.add_request("a", prompts[0], params)
        for _ in range(3):  # "a" decoding when the others' chunks come (mixed steps)
            seen += engine.step()
        engine.add_request("b", prompts[1], params)
        engine.add_request("c", prompts[2], params)
        while engine.has_unfinished():
            seen += engine.step()
        return [(o.request_id, o.new_token_ids, o.new_logprobs, o.prompt_logprobs) for o in seen]

    narrow = run(True)
    assert torch.bfloat16 in asked
    asked.clear()
    wide = run(False)
    assert torch.bfloat16 not in asked
    assert narrow == wide


@pytest.mark.parametrize("method", ["int8", "w8a8_int8", "int4", "awq"])
def test_weight_only_methods_multiply_the_head_from_q8_0_blocks(float_tiny, method):
    """On CPU the head is Q8_0 blocks; the tied embedding looks up the same weights dequantised, and
    the head multiplies by that table past FEW_ROWS rows, so a row's logits do not depend on how many
    rows share the step."""
    quant = load_model("random:tiny", progress=False, seed=3, quantization=method)
    head = quant.model.lm_head
    assert isinstance(head, GGUFLinear) and [t.name for t in head.types] == ["Q8_0"]
    assert head.kernels is not None  # prepare_for_cpu gave it the C kernels
    assert quant.model.embed_tokens.weight.data_ptr() == head.dense.data_ptr()
    assert torch.equal(head.dense, head.dequantize())
    float_head = float_tiny.model.lm_head.weight
    assert rel_err(head.dense, float_head) < 0.01  # Q8_0: 8 bits and a scale per 32 weights
    x = torch.randn(GGUFLinear.FEW_ROWS + 1, float_head.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        few, many = head(x[:3]), head(x)
    if head.qdot_kernels is not None:  # int8 dot products (AVX-512 VNNI): every row count, row by row
        assert torch.equal(few, many[:3])
        assert rel_err(many, x @ head.dense.T) < 1e-4  # x in two int8 parts: ~15 bits
    else:
        assert torch.allclose(few, many[:3], rtol=1e-4, atol=1e-5)
        assert torch.allclose(many, x @ head.dense.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["int4", "bf16", "w8a8_int8"])
def test_quantized_model_serves_through_the_engine(float_tiny, method):
    """The paged engine path (batched decode, prefill) over a quantized model (bf16: bfloat16 weights,
    the tied embedding among them, under float32 activations and a float32 KV cache)."""
    loaded = load_model("random:tiny", progress=False, seed=3, quantization=method)
    engine = LLMEngine(EngineConfig(model="random:tiny", load_progress=False, num_kv_blocks=64), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), list(range(100 + i, 120 + 3 * i)), params)
    outs = run_to_completion(engine)
    assert all(len(tokens) == 6 for tokens in outs.values())
    assert engine.runner.kv_cache.dtype == torch.float32
    if load_kernels() is not None:  # float32 activations: the C norms and SwiGLU, whatever the weights
        assert loaded.model.norm.kernels is not None and loaded.model.layers[0].mlp.kernels is not None
    # bf16 projections: attention's prefill products as the fastest of the three here; else float32
    products = engine.runner.backend.prefill_products
    assert products in PREFILL_PRODUCTS if method == "bf16" else products == "float32"
    assert_no_leaks(engine)


def test_awq_folds_scales_into_the_norms(float_tiny):
    """AWQ keeps the float function: scaling alone (before rounding) leaves the logits unchanged."""
    from pdserve.engine.quant.awq import apply_awq

    model = load_model("random:tiny", progress=False, seed=3).model
    ids = torch.tensor(float_tiny.tokenizer.encode("Scales fold into the previous op. " * 3))
    want = full_forward(model, ids)
    runtime = apply_awq(model, ids, lambda k: 64)
    for name, inv in runtime.items():  # o_proj's inverse scale goes on its activation
        linear = model.get_submodule(name)
        linear.register_forward_pre_hook(lambda m, args, inv=inv: (args[0] * inv,))
    torch.testing.assert_close(full_forward(model, ids), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(model.layers[0].input_layernorm.weight, float_tiny.model.layers[0].input_layernorm.weight)


def test_smoothquant_folds_scales_into_the_norms_and_w8a8_loads_smoothed(float_tiny, w8a8_kernel):
    """SmoothQuant's scales keep the float function as AWQ's do; a w8a8_int8 load carries o_proj's inverse."""
    from pdserve.engine.quant.awq import apply_smoothquant

    model = load_model("random:tiny", progress=False, seed=3).model
    ids = torch.tensor(float_tiny.tokenizer.encode("Scales fold into the previous op. " * 3))
    want = full_forward(model, ids)
    runtime = apply_smoothquant(model, ids)
    for name, inv in runtime.items():
        model.get_submodule(name).register_forward_pre_hook(lambda m, args, inv=inv: (args[0] * inv,))
    torch.testing.assert_close(full_forward(model, ids), want, rtol=1e-4, atol=1e-4)
    quant = load_model("random:tiny", progress=False, seed=3, quantization="w8a8_int8").model
    assert all(isinstance(layer.self_attn.o_proj, W8A8Linear) for layer in quant.layers)
    assert quant.layers[0].self_attn.o_proj.input_scale is not None


@pytest.mark.slow
def test_gguf_native_matches_the_dequantised_load(default_model):
    """The default model's Q4_1 blocks kept as they are give the dequantised load's greedy tokens."""
    native = load_model(progress=False, quantization="gguf")
    assert all(type(m).__name__ == "GGUFLinear" for n, m in native.model.named_modules() if n.endswith("_proj"))
    assert [t.name for t in native.model.lm_head.types] == ["Q8_0"]  # the file's own head (its tied token_embd)
    assert weight_bytes(native.model) < 0.6 * weight_bytes(default_model.model)
    params = SamplingParams(temperature=0, max_tokens=12)
    prompt = default_model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    tokens = []
    for loaded in (default_model, native):
        engine = LLMEngine(EngineConfig(load_progress=False, num_kv_blocks=64), loaded=loaded)
        engine.add_request("r", prompt, params)
        tokens.append(run_to_completion(engine)["r"])
    assert tokens[0] == tokens[1]
    ids = torch.tensor(prompt)
    got, want = full_forward(native.model, ids), full_forward(default_model.model, ids)
    if native.model.lm_head.qdot_kernels is None:  # float32 x: the same weights, summed in another order
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    else:  # qdot's tiles: the same weights, x in two int8 parts (~15 bits) at each of 30 layers
        assert rel_err(got, want) < 2e-3


def test_quantize_model_none_is_a_no_op(float_tiny):
    model = load_model("random:tiny", progress=False, seed=3).model
    quantize_model(model, "none")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
