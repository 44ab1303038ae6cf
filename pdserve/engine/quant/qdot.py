"""Weights laid out for ``cpu_qdot.c``'s integer dot products (see its header for the layout):
tiles of 16 output rows, block by block of 32 inputs, each block's small integers then its float16
scales. ``matmul`` multiplies rows of x by one such weight."""

from __future__ import annotations

import torch

from pdserve.engine import cpu_kernels

TILE, QK = 16, 32


F16_NORMAL = (2.0**-14, 65504.0)


def supports(kernels, bits: int) -> bool:
    """Whether these kernels multiply ``bits``-bit weights (AVX-512 VNNI or AVX2 builds: both)."""
    return kernels is not None and bool(kernels.qdot_available() & (1 if bits == 4 else 2))


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % QK == 0


def f16_exact_enough(*scales: torch.Tensor) -> bool:
    """Whether scales keep float16's 11 bits (none past its range or among its subnormals): the
    tiles store them as float16, as GGUF's blocks do."""
    lo, hi = F16_NORMAL
    return all(bool(((v == 0) | ((v.abs() >= lo) & (v.abs() <= hi))).all()) for v in scales)


def _tile_scales(v: torch.Tensor) -> torch.Tensor:
    """``[n, k / 32]`` per row and block -> float16 bytes ``[n / 16, k / 32, 32]`` (16 rows a block)."""
    n, nb = v.shape
    return v.to(torch.float16).reshape(n // TILE, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``w = d * q + m`` with ``q`` ``[n, k]`` integers 0..15 and ``d``, ``m`` ``[n, k / 32]`` (stored
    as float16)."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n // TILE, 2, 8, k // QK, 8, 4)  # tile, half, row j, block, step, i
    nibbles = (g[:, 0] | (g[:, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(n // TILE, k // QK, 256)
    return torch.cat([nibbles, _tile_scales(d), _tile_scales(m)], dim=-1).contiguous()


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``w = d * q`` with ``q`` ``[n, k]`` integers -127..127 and ``d`` ``[n, k / 32]`` (stored as
    float16)."""
    n, k = q.shape
    g = (q.to(torch.int16) + 128).to(torch.uint8).reshape(n // TILE, TILE, k // QK, 8, 4)  # tile, row, block, step, i
    steps = g.permute(0, 2, 3, 1, 4).reshape(n // TILE, k // QK, 512)
    return torch.cat([steps, _tile_scales(d)], dim=-1).contiguous()


def matmul(kernels, bits: int, tiles: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``[..., k]`` (any float dtype; multiplied as float32) and W as ``tiles``
    of ``bits`` 4 or 8 (``fits`` checked when packed); the result in x's dtype."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        return matmul(kernels, bits, tiles, rows, out_features).reshape(*x.shape[:-1], out_features).to(x.dtype)
    out = torch.empty(x.shape[0], out_features)
    cpu_kernels.qdot_gemm(kernels, bits, tiles, x, out)
    return out


def unpack_q4(tiles: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_q4``'s inverse: (``q`` uint8 ``[n, k]``, ``d``, ``m`` float32 ``[n, k / 32]``, the
    float16 values)."""
    nibbles = tiles[..., :256].reshape(n // TILE, k // QK, 8, 8, 4).permute(0, 3, 1, 2, 4)  # tile, j, block, step, i
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=1).reshape(n, k)
    return q, _untile_scales(tiles[..., 256:288], n), _untile_scales(tiles[..., 288:], n)


def unpack_q8(tiles: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_q8``'s inverse: (``q`` int8 ``[n, k]``, ``d`` float32 ``[n, k / 32]``)."""
    steps = tiles[..., :512].reshape(n // TILE, k // QK, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return (steps.to(torch.int16) - 128).to(torch.int8), _untile_scales(tiles[..., 512:], n)


def _untile_scales(b: torch.Tensor, n: int) -> torch.Tensor:
    nb = b.shape[1]
    return b.contiguous().view(torch.float16).float().reshape(n // TILE, nb, TILE).transpose(1, 2).reshape(n, nb)


def dequantize(tiles: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """The float32 ``[n, k]`` weight the tiles hold (``d q + m`` or ``d q`` per block of 32)."""
    if bits == 4:
        q, d, m = unpack_q4(tiles, n, k)
        return (q.view(n, -1, QK).float() * d[..., None] + m[..., None]).view(n, k)
    q, d = unpack_q8(tiles, n, k)
    return (q.view(n, -1, QK).float() * d[..., None]).view(n, k)
