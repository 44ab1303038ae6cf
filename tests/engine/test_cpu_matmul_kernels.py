"""The C few-rows matmuls (csrc/cpu_kernels.c: ``gemv`` for one row, ``gemm_rows`` for a few, four
rows per pass over W and the rest in one more pass) against a float64 product, for every row count a
projection sends them, float32 and bfloat16 weights, sizes that are not multiples of 4; and the row
threshold each processor gets (cpu_isa.few_rows)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.cpu_isa import few_rows
from pdserve.engine.cpu_kernels import load_kernels

needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="no C compiler here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, 10))
def test_few_rows_products_equal_a_float64_matmul(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 131, generator=gen).to(dtype).contiguous()
    x = torch.randn(rows, 131, generator=gen)
    kernel = cpu_kernels.gemv if rows == 1 else cpu_kernels.gemm_rows
    out = kernel(load_kernels(), weight, x)
    expected = (x.double() @ weight.double().T).float()
    assert out.shape == (rows, 37)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    for r in range(rows):  # each row as it would be alone (a request's decode in any batch)
        alone = cpu_kernels.gemv(load_kernels(), weight, x[r : r + 1].contiguous())
        torch.testing.assert_close(out[r : r + 1], alone, rtol=1e-5, atol=1e-4)


def test_the_c_kernel_takes_up_to_8_rows_except_where_onednn_is_as_fast_from_4():
    assert few_rows("onednn", "avx2") == 8  # AVX2: the C kernel is faster up to 8 (benchmarks/decode_steps.py)
    assert few_rows("onednn", "avx512") == few_rows("onednn", "avx512_bf16") == 4
    assert few_rows("mkl", "avx2") == few_rows("mkl", "avx512") == 8
