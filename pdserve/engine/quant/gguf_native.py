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

    On CPU, where the C kernels have byte dot products (``cpu_qdot.c``: AVX-512 VNNI or AVX2),
    ``prepare_for_cpu`` moves each Q8_0 / Q4_0 / Q4_1 segment to their tiles,
    the file's own integers and float16 scales (Q4_0's offset as ``m = -8 d``), so the weights stay
    the file's bit for bit, and fewer than ``MANY_ROWS`` rows (the head: every row count) multiply
    there, x split in two int8 parts (~15 bits). Else up to ``FEW_ROWS`` float32 rows multiply from
    the blocks through ``cpu_gguf.c`` (x float32). Other types, more rows, or no kernels: the
    segment is dequantised per matmul and multiplied in float32, or, given ``dense`` (the output
    head: its float32 table kept for the embedding lookup, equal to the dequantised blocks),
    multiplied by that table.
    """

    FEW_ROWS = 64
    MANY_ROWS = 256  # (Int4Linear's measured crossover against bfloat16; float32's not measured)
    QDOT_BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4}

    def __init__(self, segments: list[Segment], in_features: int, dense: torch.Tensor | None = None):
        super().__init__(sum(s.rows for s in segments), in_features)
        self.dense = dense  # not a buffer: the embedding's parameter when tied, moved and counted there
        self.types = [s.ggml_type for s in segments]
        self.rows = [s.rows for s in segments]
        self.kernels = None  # the C kernels, set by prepare_for_cpu
        self.qdot_kernels = None  # set by prepare_for_cpu when some segment holds qdot's tiles
        # Per segment, worked out once for the matmuls: (its buffer's name, its kernel's GGML type
        # name or None, its first output column, its qdot width or None).
        self._segments, start = [], 0
        for i, s in enumerate(segments):
            self.register_buffer(f"blocks{i}", s.blocks)
            kernel = s.ggml_type.name.lower()
            self._segments.append((f"blocks{i}", kernel if kernel in cpu_kernels.GGUF_KERNEL_TYPES else None, start,
                                   None))
            start += s.rows

    def prepare_for_cpu(self, parts: int, kernels) -> None:
        self.kernels = kernels
        if self.qdot_kernels is not None or not qdot.fits(16, self.in_features):
            return
        for i, ((buffer, kernel, start, _), ggml_type, rows) in enumerate(zip(self._segments, self.types, self.rows)):
            bits = self.QDOT_BITS.get(ggml_type)
            if bits is None or not qdot.supports(kernels, bits) or not qdot.fits(rows, self.in_features):
                continue
            setattr(self, buffer, _blocks_to_tiles(ggml_type, getattr(self, buffer), rows, self.in_features))
            self._segments[i] = (buffer, kernel, start, bits)
            self.qdot_kernels = kernels

    def _segment_weight(self, i: int) -> torch.Tensor:
        buffer, _, _, bits = self._segments[i]
        blocks = getattr(self, buffer)
        if bits is not None:
            return qdot.dequantize(blocks, bits, self.rows[i], self.in_features)
        return dequantize_blocks(self.types[i], blocks, self.in_features)

    def dequantize(self) -> torch.Tensor:
        parts = [self._segment_weight(i) for i in range(len(self.types))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        cpu_rows = x.dim() == 2 and x.dtype == torch.float32 and not x.is_cuda
        qdot_rows = (cpu_rows and self.qdot_kernels is not None
                     and (x.shape[0] < self.MANY_ROWS or len(self.types) == 1 and self.dense is not None))
        if not qdot_rows and (self.kernels is None or not cpu_rows or x.shape[0] > self.FEW_ROWS):
            return F.linear(x, (self.dequantize() if self.dense is None else self.dense).to(x.dtype))
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features)
        for i, (buffer, kernel, start, bits) in enumerate(self._segments):
            blocks, part = getattr(self, buffer), out[:, start : start + self.rows[i]]
            if bits is not None and qdot_rows:
                cpu_kernels.qdot_gemm(self.qdot_kernels, bits, blocks, x, part)
            elif kernel is not None and bits is None and self.kernels is not None and x.shape[0] <= self.FEW_ROWS:
                cpu_kernels.gguf_gemm(self.kernels, kernel, blocks, x, part)
            else:
                part.copy_(F.linear(x, self._segment_weight(i)))
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ", types=" + "|".join(t.name for t in self.types)


def _blocks_to_tiles(ggml_type: GGMLQuantizationType, blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A Q8_0 / Q4_0 / Q4_1 segment's blocks as qdot's tiles: the same integers and float16 scales."""
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    b = blocks.reshape(rows, cols // 32, block_bytes)
    d = b[..., :2].contiguous().view(torch.float16).float().squeeze(-1)  # [rows, blocks]
    if ggml_type == Q.Q8_0:
        return qdot.pack_q8(b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), d)
    qs = b[..., -16:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(rows, cols)  # low nibbles first, as dequantize_blocks
    m = -8 * d if ggml_type == Q.Q4_0 else b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return qdot.pack_q4(q, d, m)


def q8_0_head(weight: torch.Tensor) -> GGUFLinear:
    """A float output head ``[vocab, hidden]`` as Q8_0 blocks (gguf's own quantizer: one float16
    scale per 32 weights, llama.cpp's usual head type), for ``use_block_head``."""
    blocks = np_quantize(weight.detach().float().cpu().numpy(), Q.Q8_0)
    return GGUFLinear([Segment(Q.Q8_0, torch.from_numpy(blocks), weight.shape[0])], weight.shape[1])


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
