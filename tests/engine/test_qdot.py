"""cpu_qdot.c: 4- and 8-bit weights times x in two int8 parts, through AVX-512 VNNI dot products
(or AVX2's pair products).

The kernel tests run where the kernels' build has them (``PDSERVE_CPU_ISA=avx2`` builds the AVX2
variant on an AVX-512 machine, as ``test_the_avx2_variant_matches`` does); the packing tests
everywhere."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.quant import qdot
from pdserve.engine.quant.formats import Int4Linear, Int8Linear


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load_kernels()
    if not qdot.supports(lib, 4):
        pytest.skip("no byte dot products (AVX-512 VNNI or AVX2) in this build of the kernels")
    return lib


def need(lib, bits: int) -> None:
    if not qdot.supports(lib, bits):
        pytest.skip(f"this build of the kernels has no {bits}-bit qdot")


def test_q4_tiles_unpack_to_what_was_packed():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 96), generator=g, dtype=torch.uint8)
    d, m = torch.rand(48, 3, generator=g).half().float(), torch.randn(48, 3, generator=g).half().float()
    q2, d2, m2 = qdot.unpack_q4(qdot.pack_q4(q, d, m), 48, 96)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernels_match_the_float_product_row_by_row(lib, bits, rows):
    """x @ W^T to ~15 bits (x in two int8 parts), and each row's result the same whatever rows share
    the call (decode steps of any size give a request the same logits)."""
    need(lib, bits)
    g = torch.Generator().manual_seed(rows)
    n, k = 96, 128
    d = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()  # (the tiles keep float16 scales)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g)
        m = (torch.randn(n, k // 32, generator=g) * 0.1).half().float()
        tiles = qdot.pack_q4(q, d, m)
        w = d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g)
        tiles = qdot.pack_q8(q, d)
        w = d.repeat_interleave(32, 1) * q
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 1, k)  # small inputs beside large ones
    x[0, :32] = 0.0  # a block of zeros (scale 0)
    got = qdot.matmul(lib, bits, tiles, x, n)
    assert rel_err(got, x.double() @ w.double().T) < 1e-4
    for r in range(rows):
        assert torch.equal(qdot.matmul(lib, bits, tiles, x[r:r + 1], n)[0], got[r])


def test_int4_layers_move_to_the_qdot_layout(lib):
    """On a VNNI processor an int4 layer keeps one copy of its weight, in cpu_qdot.c's layout, with
    the same dequantised weight as before (up to float16's rounding of its zero points), and multiplies
    every row count there: prefill's 300 rows as decode's one."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(160, 256, generator=g) * 0.05
    layer = Int4Linear(weight, 32)
    before = layer.dequantize()
    layer.prepare_for_cpu(1, lib)
    assert layer.qdot_kernels is lib and layer.scales_zeros is None
    torch.testing.assert_close(layer.dequantize(), before, rtol=0, atol=1e-4)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 256, generator=g)
        assert rel_err(layer(x), x @ before.T) < 1e-3
        assert rel_err(layer(x), x @ layer.dequantize().T) < 1e-4


def test_int4_many_rows_unpack_bfloat16_weights_as_tinygemms(lib):
    """From MANY_ROWS rows the bfloat16 weight comes from the tiles, in tinygemm's form
    ((q - 8) d + z: q d + m would cancel in bfloat16, 2.3x the error; perplexity 20.01 -> 20.18)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bfloat16 matmuls here: the tiles serve every row count")
    g = torch.Generator().manual_seed(1)
    layer = Int4Linear(torch.randn(192, 256, generator=g) * 0.05, 32)
    before, tinygemms = layer.dequantize(), layer._bf16_weight().float()
    layer.prepare_for_cpu(1, lib)
    assert layer.dequant_many_rows
    assert rel_err(layer._bf16_weight().float(), before) < 1.1 * rel_err(tinygemms, before)


def test_scales_outside_float16_keep_torchs_kernel(lib):
    layer = Int4Linear(torch.randn(32, 64) * 1e-7, 32)  # scales ~1e-8: float16 subnormals
    layer.prepare_for_cpu(1, lib)
    assert layer.qdot_kernels is None


def test_int8_layers_move_to_the_qdot_layout(lib):
    need(lib, 8)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 96, generator=g) * 0.05
    layer = Int8Linear(weight)
    before = layer.dequantize()
    layer.prepare_for_cpu(1, lib)
    assert layer.qdot_kernels is lib and layer.scales is None
    torch.testing.assert_close(layer.dequantize(), before, rtol=2**-11, atol=0)  # scales as float16
    x = torch.randn(5, 96, generator=g)
    assert rel_err(layer(x), x @ layer.dequantize().T) < 1e-4


def test_the_avx2_variant_matches(tmp_path):
    """The AVX2 build (no VNNI) runs this file's tests in a child process capped at AVX2."""
    import os
    import subprocess
    import sys

    from pdserve.engine.cpu_isa import cpu_flags

    if not {"avx2", "fma", "f16c"} <= cpu_flags() or cpu_kernels.load_kernels() is None:
        pytest.skip("needs an AVX2 processor and a C compiler")
    if os.environ.get("PDSERVE_CPU_ISA") == "avx2":
        pytest.skip("this is the AVX2 run")
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gguf_segments_multiply_from_tiles_with_the_files_weights(lib, rows):
    """A fused Q4_1 | Q8_0 | F16 | Q4_0 projection: the Q segments move to qdot's tiles holding the
    file's weights bit for bit; x @ W^T to ~15 bits at any row count."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from tests.engine.test_quantization import fused_gguf_layer

    rng = np.random.default_rng(rows)
    layer = fused_gguf_layer(rng, ((Q.Q4_1, 48), (Q.Q8_0, 32), (Q.F16, 16), (Q.Q4_0, 48)))
    before = layer.dequantize()
    layer.prepare_for_cpu(1, lib)
    assert [bits for *_, bits in layer._segments] == [4, 8 if qdot.supports(lib, 8) else None, None, 4]
    assert torch.equal(layer.dequantize(), before)
    x = torch.from_numpy(rng.standard_normal((rows, 96)).astype(np.float32))
    assert rel_err(layer(x), x @ before.T) < 1e-4
