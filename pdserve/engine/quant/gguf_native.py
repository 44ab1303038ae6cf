"""GGUF-native weights: the file's quantized blocks kept as they are, dequantised per matmul.

A fused projection (qkv = attn_q | attn_k | attn_v, gate_up = ffn_gate | ffn_up) is a list of
row segments, each with its own GGML type: files mix types (Q4_K_M keeps attn_v and ffn_down
in Q6_K). Q8_0, Q4_0 and Q4_1 (the default model's) dequantise with torch ops; other types go
through ``gguf.quants`` (numpy, slower). Embeddings, norms and the output head stay float.

Block layouts (32 weights a block, all little-endian)::

    Q8_0: d (f16) | 32 x int8                        w = d * q
    Q4_0: d (f16) | 16 bytes: w[i] low nibble, w[i+16] high      w = d * (q - 8)
    Q4_1: d (f16) | m (f16) | 16 bytes, as Q4_0                   w = d * q + m
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

from pdserve.engine.gguf_file import GGUFFile
from pdserve.engine.quant.formats import QuantLinear

Q = GGMLQuantizationType
TORCH_TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1)


@dataclass
class Segment:
    ggml_type: GGMLQuantizationType
    blocks: torch.Tensor  # uint8 [rows, bytes per row]
    rows: int


def dequantize_blocks(ggml_type: GGMLQuantizationType, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 ``[rows, bytes per row]`` of one GGML type -> float32 ``[rows, cols]``."""
    rows = blocks.shape[0]
    if ggml_type == Q.F32:
        return blocks.view(torch.float32).reshape(rows, cols)
    if ggml_type == Q.F16:
        return blocks.view(torch.float16).float().reshape(rows, cols)
    if ggml_type not in TORCH_TYPES:
        out = np_dequantize(blocks.numpy(), ggml_type)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(rows, cols)
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    b = blocks.reshape(rows, cols // 32, block_bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if ggml_type == Q.Q8_0:
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(rows, cols)
    qs = b[..., -16:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # [rows, nb, 32]: low nibbles first
    if ggml_type == Q.Q4_0:
        return ((q - 8.0) * d).reshape(rows, cols)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).reshape(rows, cols)


class GGUFLinear(QuantLinear):
    def __init__(self, segments: list[Segment], in_features: int):
        super().__init__(sum(s.rows for s in segments), in_features)
        self.types = [s.ggml_type for s in segments]
        self.rows = [s.rows for s in segments]
        for i, s in enumerate(segments):
            self.register_buffer(f"blocks{i}", s.blocks)

    def dequantize(self) -> torch.Tensor:
        parts = [dequantize_blocks(t, getattr(self, f"blocks{i}"), self.in_features) for i, t in enumerate(self.types)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize().to(x.dtype))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", types=" + "|".join(t.name for t in self.types)


def read_segment(gguf: GGUFFile, blob: np.ndarray, name: str) -> Segment:
    t = gguf.tensors[name]
    rows = int(np.prod(t.shape[:-1]))
    raw = np.array(blob[t.offset : t.offset + t.nbytes]).reshape(rows, -1)  # a copy: the file can close
    return Segment(GGMLQuantizationType(t.ggml_type), torch.from_numpy(raw), rows)


# Our fused projections and the GGUF tensors they are made of, per layer.
FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def gguf_linears(path: Path, num_layers: int) -> dict[str, GGUFLinear]:
    """Our layer Linear names (``layers.3.mlp.down_proj``) -> their GGUF-native replacements."""
    gguf = GGUFFile(path)
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    out = {}
    for i in range(num_layers):
        for ours, theirs in FUSED.items():
            segments = [read_segment(gguf, blob, f"blk.{i}.{name}.weight") for name in theirs]
            in_features = gguf.tensors[f"blk.{i}.{theirs[0]}.weight"].shape[-1]
            out[f"layers.{i}.{ours}"] = GGUFLinear(segments, in_features)
    return out
