"""GGUF-native weights: the file's quantized blocks kept as they are, dequantised per matmul.

A fused projection (qkv = attn_q | attn_k | attn_v, gate_up = ffn_gate | ffn_up) is a list of
row segments, each with its own GGML type: files mix types (Q4_K_M keeps attn_v and ffn_down
in Q6_K). Q8_0, Q4_0, Q4_1 (the default model's), Q5_0, Q4_K and Q6_K (Gemma 3 270M's Q4_K_M)
dequantise with torch ops, each the same float32 arithmetic as ``gguf.quants`` (so the weights are
bit for bit those the float path loads); other types go through ``gguf.quants`` (numpy, slower).
Embeddings and norms stay float; the output head too, except on CPU where the file's head (or tied
token_embd) is Q8_0/Q4_0/Q4_1 (``gguf_linears(head=True)``: decode multiplies from those blocks;
``q8_0_head`` makes such a head from a float one for the other weight-only methods). Gemma 3 files
keep q/k rows in rotate-half order: those segments' rows are permuted to ours (a row permutation of whole block rows).

Block layouts (32 weights a block, all little-endian)::

    Q8_0: d (f16) | 32 x int8                        w = d * q
    Q4_0: d (f16) | 16 bytes: w[i] low nibble, w[i+16] high      w = d * (q - 8)
    Q4_1: d (f16) | m (f16) | 16 bytes, as Q4_0                   w = d * q + m
    Q5_0: d (f16) | 4 bytes: bit i the 5th bit of w[i] | 16 bytes, as Q4_0    w = d * (q - 16)

and 256 weights a super-block in 8 (Q4_K) or 16 (Q6_K) sub-blocks::

    Q4_K: d, dmin (f16) | 12 bytes: 8 x 6-bit scale and min | 128 bytes of nibbles
                                                   w = d * sc[j] * q - dmin * m[j]
    Q6_K: 128 bytes low nibbles | 64 bytes high 2 bits | 16 x int8 scale | d (f16)
                                                   w = d * sc[j] * (q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize

from pdserve.engine import cpu_kernels
from pdserve.engine.gguf_file import GGUFFile
from pdserve.engine.quant import qdot
from pdserve.engine.quant.formats import QuantLinear

Q = GGMLQuantizationType
TORCH_TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K)
_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)  # Q5_0's fifth bits, weight i at bit i


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
    if ggml_type in (Q.Q4_K, Q.Q6_K):
        super_blocks = blocks.reshape(-1, block_bytes)
        return (_q4_k(super_blocks) if ggml_type == Q.Q4_K else _q6_k(super_blocks)).reshape(rows, cols)
    b = blocks.reshape(rows, cols // 32, block_bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if ggml_type == Q.Q8_0:
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(rows, cols)
    qs = b[..., -16:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # [rows, nb, 32]: low nibbles first
    if ggml_type == Q.Q4_0:
        return ((q - 8.0) * d).reshape(rows, cols)
    if ggml_type == Q.Q5_0:
        bits = b[..., 2:6].contiguous().view(torch.int32)  # [rows, nb, 1]: bit i belongs to weight i
        high = (bits >> _BIT_POSITIONS) & 1
        return (d * (q + (high << 4).float() - 16.0)).reshape(rows, cols)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).reshape(rows, cols)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 144]`` Q4_K super-blocks -> float32 ``[n, 256]`` (gguf.quants' order of operations)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    lo, mid, hi = b[:, 4:16].reshape(n, 3, 4).unbind(1)  # 6-bit scales and mins, their high bits spread
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    scale = (d * sc.float()).reshape(n, 8, 1)
    offset = (dmin * mn.float()).reshape(n, 8, 1)
    qs = b[:, 16:].reshape(n, 4, 1, 32)  # each 32 bytes: low nibbles one sub-block, high the next
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 210]`` Q6_K super-blocks -> float32 ``[n, 256]`` (gguf.quants' order of operations)."""
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    scale = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    ql = ql.reshape(n, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = qh.reshape(n, 2, 1, 32)
    high = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return (scale * q).reshape(n, 256)


class GGUFLinear(QuantLinear):
    """A projection as the file stores it: one segment of blocks per GGUF tensor it fuses.

    On CPU with the C kernels (``cpu_gguf.c``), up to ``FEW_ROWS`` float32 rows (decode steps)
    multiply straight from the Q8_0 / Q4_0 / Q4_1 blocks: each weight is read as its 4.5-8.5 bits,
    never dequantised to memory. Other types, more rows, or no kernels: the segment is dequantised
    per matmul and multiplied in float32, or, given ``dense`` (the output head: its float32 table
    kept for the embedding lookup, equal to the dequantised blocks), multiplied by that table.

    With ``int8_activations`` (the head ``q8_0_head`` makes for the other weight-only methods) and
    int8 dot products in the kernels (``cpu_qdot.c``), a single Q8_0 segment moves to their layout
    and every row count multiplies there, x rounded to int8 per 32 inputs (``dense`` then stands for
    the blocks).
    """

    FEW_ROWS = 64

    def __init__(self, segments: list[Segment], in_features: int, dense: torch.Tensor | None = None,
                 int8_activations: bool = False):
        super().__init__(sum(s.rows for s in segments), in_features)
        self.dense = dense  # not a buffer: the embedding's parameter when tied, moved and counted there
        self.int8_activations = int8_activations
        self.qdot_kernels = None  # set by prepare_for_cpu when blocks0 holds qdot.pack_q8's tiles
        self.types = [s.ggml_type for s in segments]
        self.rows = [s.rows for s in segments]
        self.kernels = None  # the C kernels, set by prepare_for_cpu
        # Per segment, worked out once for the matmuls: (its buffer's name, its kernel's GGML type
        # name or None, its first output column).
        self._segments, start = [], 0
        for i, s in enumerate(segments):
            self.register_buffer(f"blocks{i}", s.blocks)
            kernel = s.ggml_type.name.lower()
            self._segments.append((f"blocks{i}", kernel if kernel in cpu_kernels.GGUF_KERNEL_TYPES else None, start))
            start += s.rows

    def prepare_for_cpu(self, parts: int, kernels) -> None:
        self.kernels = kernels
        if (self.int8_activations and qdot.supports(kernels, 8) and self.types == [Q.Q8_0]
                and self.dense is not None and self.qdot_kernels is None
                and qdot.fits(self.out_features, self.in_features)):
            b = self.blocks0.reshape(self.out_features, -1, 34)
            q = b[..., 2:].contiguous().view(torch.int8).reshape(self.out_features, self.in_features)
            self.blocks0 = qdot.pack_q8(q, b[..., :2].contiguous().view(torch.float16).float().squeeze(-1))
            self.qdot_kernels = kernels

    def dequantize(self) -> torch.Tensor:
        if self.qdot_kernels is not None:
            return self.dense
        parts = [dequantize_blocks(t, getattr(self, f"blocks{i}"), self.in_features) for i, t in enumerate(self.types)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.qdot_kernels is not None and not x.is_cuda:
            return qdot.matmul(self.qdot_kernels, 8, self.blocks0, x, self.out_features)
        if (self.kernels is None or x.dim() != 2 or x.shape[0] > self.FEW_ROWS or x.dtype != torch.float32
                or x.is_cuda):
            return F.linear(x, (self.dequantize() if self.dense is None else self.dense).to(x.dtype))
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features)
        for (buffer, kernel, start), ggml_type, rows in zip(self._segments, self.types, self.rows):
            blocks, part = getattr(self, buffer), out[:, start : start + rows]
            if kernel is not None:
                cpu_kernels.gguf_gemm(self.kernels, kernel, blocks, x, part)
            else:
                part.copy_(F.linear(x, dequantize_blocks(ggml_type, blocks, self.in_features)))
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ", types=" + "|".join(t.name for t in self.types)


def q8_0_head(weight: torch.Tensor) -> GGUFLinear:
    """A float output head ``[vocab, hidden]`` as Q8_0 blocks (gguf's own quantizer: one float16
    scale per 32 weights, llama.cpp's usual head type), for ``use_block_head``; multiplied in int8
    dot products where the kernels have them (the layers' int4 already rounds x)."""
    blocks = np_quantize(weight.detach().float().cpu().numpy(), Q.Q8_0)
    return GGUFLinear([Segment(Q.Q8_0, torch.from_numpy(blocks), weight.shape[0])], weight.shape[1],
                      int8_activations=True)


def use_block_head(model, head: GGUFLinear) -> None:
    """Make ``head`` the model's output head. Its dequantised blocks become the float table it
    multiplies by past ``FEW_ROWS`` rows and, when the embedding is tied, the embedding's table
    too, so both read the same weights at every batch size and no float table is kept twice."""
    head.dense = head.dequantize()
    model.lm_head = head
    if model.config.tie_word_embeddings:
        model.embed_tokens.weight = torch.nn.Parameter(head.dense, requires_grad=False)


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


def gguf_linears(path: Path, config, head: bool = False) -> dict[str, GGUFLinear]:
    """Our layer Linear names (``layers.3.mlp.down_proj``) -> their GGUF-native replacements, for a
    model of ``config`` (a ModelConfig: Llama, or Gemma 3 whose q/k rows are reordered). With
    ``head``, also ``lm_head`` from the file's own blocks (``output.weight``, else the tied
    ``token_embd.weight``) when their type has a C kernel: decode multiplies every token by the whole
    head, and SmolLM2's Q8_0 table is 30 MiB against 108 in float32."""
    from pdserve.engine.loader import interleave_rope_rows

    gguf = GGUFFile(path)
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    out = {}
    name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    if (head and name in gguf.tensors
            and GGMLQuantizationType(gguf.tensors[name].ggml_type).name.lower() in cpu_kernels.GGUF_KERNEL_TYPES):
        out["lm_head"] = GGUFLinear([read_segment(gguf, blob, name)], gguf.tensors[name].shape[-1])
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads} if config.architecture == "gemma3" else {}
    for i in range(config.num_layers):
        for ours, theirs in FUSED.items():
            segments = [read_segment(gguf, blob, f"blk.{i}.{name}.weight") for name in theirs]
            for segment, name in zip(segments, theirs):
                if name in heads:
                    segment.blocks = interleave_rope_rows(segment.blocks, heads[name]).contiguous()
            in_features = gguf.tensors[f"blk.{i}.{theirs[0]}.weight"].shape[-1]
            out[f"layers.{i}.{ours}"] = GGUFLinear(segments, in_features)
    return out
