"""Weights laid out for ``cpu_qdot.c``'s integer dot products (see its header for the layout):
tiles of 16 output rows, block by block of 32 inputs, each block's small integers then its float32
scales. ``matmul`` multiplies rows of x by one such weight."""

from __future__ import annotations

import torch

from pdserve.engine import cpu_kernels

TILE, QK = 16, 32


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % QK == 0


def _tile_floats(v: torch.Tensor) -> torch.Tensor:
    """``[n, k / 32]`` float32 per row and block -> uint8 ``[n / 16, k / 32, 64]`` (16 rows a block)."""
    n, nb = v.shape
    return v.float().reshape(n // TILE, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``w = d * q + m`` with ``q`` ``[n, k]`` integers 0..15 and ``d``, ``m`` ``[n, k / 32]``."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n // TILE, 2, 8, k // QK, 8, 4)  # tile, half, row j, block, step, i
    nibbles = (g[:, 0] | (g[:, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(n // TILE, k // QK, 256)
    return torch.cat([nibbles, _tile_floats(d), _tile_floats(m)], dim=-1).contiguous()


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``w = d * q`` with ``q`` ``[n, k]`` integers -127..127 and ``d`` ``[n, k / 32]``."""
    n, k = q.shape
    g = (q.to(torch.int16) + 128).to(torch.uint8).reshape(n // TILE, TILE, k // QK, 8, 4)  # tile, row, block, step, i
    steps = g.permute(0, 2, 3, 1, 4).reshape(n // TILE, k // QK, 512)
    return torch.cat([steps, _tile_floats(d)], dim=-1).contiguous()


def matmul(kernels, bits: int, tiles: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``[..., k]`` (any float dtype; multiplied as float32 rounded to int8 per
    32 inputs) and W as ``tiles`` of ``bits`` 4 or 8; the result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = torch.empty(rows.shape[0], out_features)
    cpu_kernels.qdot_gemm(kernels, bits, tiles, rows, out)
    return out.reshape(*x.shape[:-1], out_features).to(x.dtype)


def unpack_q4(tiles: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_q4``'s inverse: (``q`` uint8 ``[n, k]``, ``d``, ``m`` float32 ``[n, k / 32]``)."""
    nibbles = tiles[..., :256].reshape(n // TILE, k // QK, 8, 8, 4).permute(0, 3, 1, 2, 4)  # tile, j, block, step, i
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=1).reshape(n, k)
    return q, _untile_floats(tiles[..., 256:320], n), _untile_floats(tiles[..., 320:], n)


def _untile_floats(b: torch.Tensor, n: int) -> torch.Tensor:
    nb = b.shape[1]
    return b.contiguous().view(torch.float32).reshape(n // TILE, nb, TILE).transpose(1, 2).reshape(n, nb)
