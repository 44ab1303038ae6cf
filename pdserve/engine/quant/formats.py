"""Weight-only quantized linear layers: drop-ins for ``model.Linear``, built from its float weight.

Each keeps only the quantized weight (no float copy) and computes ``y = x W^T`` of the same
shape and dtype as ``model.Linear``:

| class | weight | matmul |
|---|---|---|
| ``Int8Linear`` | int8, one symmetric scale per output row | ``aten._weight_int8pack_mm`` |
| ``W8A8Linear`` | as ``Int8Linear``; activations int8 per row, 32+ rows | ``_int_mm`` (VNNI), oneDNN qlinear (AVX2) |
| ``Int4Linear`` | 4-bit, asymmetric per group of ``group_size`` inputs | ``aten._weight_int4pack_mm_for_cpu`` |
| ``Fp8Linear`` | float8 e4m3, per-tensor or per-row scale | ``torch._scaled_mm`` (CUDA, FP8 GPUs only) |
| ``BF16Linear`` | bfloat16 (float32 activations) | C kernels (1-4 rows), oneDNN bfloat16 with a packed weight |

On CPUs the int8/int4 kernels run with bfloat16 activations: fed float32 they are 7-40x slower
(see shared DEPENDENCIES.md). Where a kernel is missing or refuses a shape, the layer
dequantises its weight and runs ``F.linear`` instead (correct, not fast).

AWQ's per-input-channel scale, where it cannot be folded into the previous op, is applied to
the activation (``input_scale``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import cpu_kernels
from pdserve.engine.model import Linear, onednn_linear
from pdserve.engine.quant import qdot

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8 e4m3fn
INT4_GROUP_SIZES = (32, 64, 128)


def _kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Activations' dtype inside the int kernels: bf16 on CPUs (the fast path), else the model's."""
    return torch.bfloat16 if device.type == "cpu" or dtype == torch.float32 else dtype


class QuantLinear(nn.Module):
    """What the quantized layers share: the shape, an optional input scale, the float fallback."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("input_scale", None)  # AWQ's 1/s when no previous op absorbs it

    def set_input_scale(self, inv_scale: torch.Tensor) -> None:
        self.input_scale = inv_scale.float().contiguous()

    def prepare_for_cpu(self, parts: int, kernels) -> None:
        """Nothing to do: the split-row layout of ``model.Linear`` is for float weights."""

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[out, in]`` (what the layer multiplies by, up to rounding)."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        return self.matmul(x)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _try_kernel(layer: QuantLinear, fn, weight: torch.Tensor) -> bool:
    """Whether ``fn`` runs and agrees with the dequantised ``weight`` on a small random input."""
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0)).to(weight.device)
    try:
        got = fn(x).float()
    except (RuntimeError, NotImplementedError) as e:
        log.info("%s: kernel unavailable (%s); dequantising per matmul", type(layer).__name__, e)
        return False
    want = F.linear(x, weight)
    ok = bool(torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()) + 1e-6))
    if not ok:
        log.warning("%s: kernel disagrees with the dequantised weight; dequantising per matmul", type(layer).__name__)
    return ok


# ---- int8 ---------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: ``w ~ q * scale[:, None]``, q in [-levels, levels]."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / float(levels)
    q = torch.round(w.float() / scale[:, None]).clamp_(-levels, levels).to(torch.int8)
    return q, scale


class Int8Linear(QuantLinear):
    """Per-output-row int8 weights: torch's kernel (``_weight_int8pack_mm``), or, where the C kernels
    have byte dot products (AVX-512 VNNI or AVX2), ``cpu_qdot.c`` at every row count after
    ``prepare_for_cpu`` moves the weight to its layout (the row's scale repeated per 32 inputs)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(*weight.shape)
        q, scale = quantize_int8(weight)
        self.act_dtype = _kernel_dtype(weight.device, weight.dtype)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scale.to(self.act_dtype))  # the kernel wants x's dtype
        self.qdot_kernels = None  # set by prepare_for_cpu when qweight holds qdot.pack_q8's tiles
        self.use_kernel = _try_kernel(self, self._kernel, self.dequantize())

    def prepare_for_cpu(self, parts: int, kernels) -> None:
        if (not qdot.supports(kernels, 8) or self.qdot_kernels is not None
                or self.qweight.device.type != "cpu" or not qdot.fits(self.out_features, self.in_features)
                or not qdot.f16_exact_enough(self.scales.float())):
            return
        blocks = self.in_features // qdot.QK
        self.qweight = qdot.pack_q8(self.qweight, self.scales.float()[:, None].expand(-1, blocks))
        self.scales = None
        self.use_kernel = False
        self.qdot_kernels = kernels

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype), self.qweight, self.scales)

    def dequantize(self) -> torch.Tensor:
        if self.qdot_kernels is not None:
            return qdot.dequantize(self.qweight, 8, self.out_features, self.in_features)
        return self.qweight.float() * self.scales.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.qdot_kernels is not None:
            return qdot.matmul(self.qdot_kernels, 8, self.qweight, x, self.out_features)
        if self.use_kernel:
            return self._kernel(x.contiguous()).to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype))


class W8A8Linear(Int8Linear):
    """int8 weights and, from ``MANY_ROWS`` rows (prefill chunks), int8 activations: each row of x
    rounded to int8 with its own symmetric scale per matmul (vLLM's dynamic per-token W8A8, SGLang's
    ``w8a8_int8``), multiplied in int32 and scaled back by the row's and the output channel's scales.
    Fewer rows (decode, bound by streaming the weight) take ``Int8Linear``'s products, x kept to ~15
    bits. The int32 products come from one of two kernels (``int8_matmuls``):

    - ``int_mm``: ``torch._int_mm`` (oneDNN: VNNI's ``vpdpbusd``, AMX's int8 tiles; CUDA), with the
      same 8-bit weights as the decode products, where the CPU has AVX-512 VNNI;
    - ``qlinear``: oneDNN's quantized inner product (``onednn::qlinear_pointwise``, the kernels of
      torch's x86 quantization) on AVX2 without VNNI. Its ``vpmaddubsw`` adds two products of an
      unsigned and a signed byte in a saturating int16, so the activations go in as unsigned bytes
      (``q + 128``, the zero point 128) and the weight's copy for it is rounded to 7 bits ([-63, 63],
      its own per-row scale): 2 x 255 x 63 < 32,767, no pair saturates, the sums are exact. (With
      8-bit weights: off by up to ~135,000.) 2.5-2.8x float32's rate at 512 x 576 x 1536 on 2 AVX2
      Zen 3 cores.

    Without either (no exact kernel, a CPU below AVX2) the layer keeps ``Int8Linear``'s products at
    every row count, one weight copy, and says so once."""

    MANY_ROWS = 32

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.kernel = int8_matmuls(weight.device)  # None: no int8 activations here
        self.packed_bytes = 0  # held outside the buffers (oneDNN's opaque layout): for weight_bytes
        q, scale = (None, None) if self.kernel is None else quantize_int8(
            weight, weight_levels(self.kernel))  # a second copy only where it is used
        self.register_buffer("mm_scale", None if scale is None else scale.float())
        if self.kernel == "qlinear":
            self.mm_weight = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
            self.packed_bytes = q.numel()
            self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        else:  # [out, in]; .t() is _int_mm's column-major mat2
            self.register_buffer("mm_weight", None if q is None else q.contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is None or rows.shape[0] < self.MANY_ROWS:
            return super().matmul(x)
        xq, x_scale = quantize_int8(rows)
        if self.kernel == "int_mm":
            out = torch._int_mm(xq, self.mm_weight.t()).float().mul_(self.mm_scale)
        else:
            out = _qlinear(xq, self.mm_weight, self.mm_scale, self._zero_points)
        out.mul_(x_scale[:, None])
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


QLINEAR_WEIGHT_LEVELS = 63  # the qlinear kernel's weights: 7 bits, so no byte pair saturates (W8A8Linear)


def weight_levels(kernel: str | None) -> int:
    """The levels each side of zero of the weight's copy ``kernel`` multiplies (``int8_matmuls``)."""
    return QLINEAR_WEIGHT_LEVELS if kernel == "qlinear" else 127


def _qlinear(xq: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor) -> torch.Tensor:
    """float32 ``sum_k xq[m, k] * w[n, k] * w_scale[n]`` through oneDNN's u8 x s8 inner product: ``xq``
    (int8) goes in as ``xq + 128`` with the zero point 128 (oneDNN takes 128 x the weight's row sums
    off in int32)."""
    return torch.ops.onednn.qlinear_pointwise(xq.view(torch.uint8) ^ 0x80, 1.0, 128, packed, w_scale, w_zero,
                                              None, 1.0, 0, torch.float32, "none", [], "")


_INT8_MATMULS: dict[str, str | None] = {}


def int8_matmuls(device: torch.device) -> str | None:
    """Which exact int8 kernel ``W8A8Linear`` multiplies activations with on ``device`` (its
    docstring): ``"int_mm"``, ``"qlinear"``, or None; probed once per device kind, said once."""
    if device.type in _INT8_MATMULS:
        return _INT8_MATMULS[device.type]
    kernel = None
    if device.type != "cpu":
        kernel = "int_mm" if int_mm_exact(device) else None
    else:
        from pdserve.engine.cpu_isa import ORDER, active_isa, int8_dot

        if int8_dot() and int_mm_exact(device):
            kernel = "int_mm"
        elif ORDER.index(active_isa()) >= ORDER.index("avx2") and qlinear_exact():
            kernel = "qlinear"
    if kernel is None:
        log.warning("w8a8_int8: no exact int8 matmul on this %s: activations stay ~15 bits, the int8 "
                    "weight-only products, at every row count", device.type)
    else:
        log.info("w8a8_int8: prefill activations int8 through %s", {
            "int_mm": "torch._int_mm (int8 weights)",
            "qlinear": "oneDNN's qlinear (weights rounded to 7 bits for it: AVX2's byte pairs saturate at 8)"}[kernel])
    _INT8_MATMULS[device.type] = kernel
    return kernel


def _probe_bytes(device: torch.device, low: int, high: int, w_value: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows at both ends of a byte range against a weight at ``w_value``: where a kernel saturates."""
    k = 256
    x = torch.full((MANY_ROWS_PROBE, k), low, dtype=torch.int8, device=device)
    x[::2] = high
    w = torch.full((64, k), w_value, dtype=torch.int8, device=device)
    return x, w, k


def int_mm_exact(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` gives exact int32 sums on ``device`` for bytes at the ends of int8's
    range (it does on VNNI and AMX; oneDNN capped at AVX2 saturates)."""
    x, w, k = _probe_bytes(device, -127, 127, 127)
    try:
        got = torch._int_mm(x, w.t())
    except (RuntimeError, NotImplementedError) as e:
        log.info("w8a8_int8: no int8 matmul here (%s)", e)
        return False
    exact = bool((got == (x[:, :1].int() * 127 * k)).all())
    if not exact:
        log.info("w8a8_int8: torch._int_mm is not exact here (saturating pair products)")
    return exact


def qlinear_exact() -> bool:
    """Whether oneDNN's quantized inner product is here and exact on the bytes ``W8A8Linear`` gives it
    (activations at both ends of int8's range, 7-bit weights at theirs)."""
    x, w, k = _probe_bytes(torch.device("cpu"), -128, 127, QLINEAR_WEIGHT_LEVELS)
    try:
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        got = _qlinear(x, packed, torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.int64))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        log.info("w8a8_int8: no oneDNN qlinear here (%s)", e)
        return False
    exact = bool((got.double() == (x[:, :1].double() * QLINEAR_WEIGHT_LEVELS * k)).all())
    if not exact:
        log.info("w8a8_int8: oneDNN's qlinear is not exact here")
    return exact


MANY_ROWS_PROBE = 32  # (CUDA's _int_mm wants more than 16 rows)


# ---- int4 ---------------------------------------------------------------------------------


def int4_group_size(in_features: int, wanted: int) -> int | None:
    """``wanted``, or the largest smaller allowed group size dividing ``in_features`` (576 = 9 x 64)."""
    for g in sorted((g for g in INT4_GROUP_SIZES if g <= wanted), reverse=True):
        if in_features % g == 0:
            return g
    return None


def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype = torch.bfloat16):
    """Asymmetric 4-bit per group of ``group`` inputs, in tinygemm's convention.

        w ~ (q - 8) * scale + zero,   q in [0, 15],   scale, zero: [out, in / group]

    Scales and zeros are rounded to ``dtype`` (the kernel's) before q is chosen, so the
    dequantised weight is exactly what the kernel multiplies by.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(dtype).float()
    zero = (lo + 8.0 * scale).to(dtype).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8.0).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    g = q.float().reshape(n, k // group, group)
    return ((g - 8.0) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` values 0..15 -> ``[n, k / 2]`` bytes (even column in the low nibble)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


# aten._convert_weight_to_int4pack_for_cpu's layout: [out / 64, in, 32] bytes, the low nibble of
# byte (b, k, j) is q[64 b + j, k] and the high one q[64 b + 32 + j, k] (checked per layer at load).
CPU_PACK_ROWS = 64


def unpack_cpu_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """q ``[out, in]`` (0..15, uint8) from the CPU int4 kernel's packed weight."""
    blocks = packed.view(out_features // CPU_PACK_ROWS, in_features, CPU_PACK_ROWS // 2)
    halves = torch.stack([blocks & 0xF, blocks >> 4], dim=1)  # [out / 64, 2, in, 32]
    return halves.transpose(2, 3).reshape(out_features, in_features)


class Int4Linear(QuantLinear):
    """Group-wise 4-bit weights; ``fake_quant`` gives the float weight the layer would use (AWQ's search).

    On CPUs the kernel (tinygemm's) multiplies fewer than ``MANY_ROWS`` rows: decode reads half a
    byte per weight. For more rows (prefill chunks) it is no faster than float32 (1,024 rows of
    3072 x 576: 40.8 ms, float32 42.0 ms), so there, where the processor has bfloat16 dot products,
    the weight is unpacked from the kernel's layout to bfloat16 for the call and oneDNN multiplies
    (19.6 ms; 1.6-2.7x faster than either from 256 to 2,048 rows on SmolLM2's shapes). The weight
    is not kept dequantised.

    Where the C kernels have byte dot products (``cpu_qdot.c``: AVX-512 VNNI, or AVX2's pair
    products), ``prepare_for_cpu`` moves the weight to their layout (``qdot.pack_q4``, tinygemm's
    dropped) and fewer than ``MANY_ROWS`` rows multiply there, x split in two int8 parts per 32
    inputs (~15 bits; tinygemm rounds x to bfloat16's 8): on the AMX Xeon with VNNI, 2.4-3.5x faster
    than tinygemm from 1 to 255 rows on SmolLM2's shapes. From ``MANY_ROWS`` rows the bfloat16
    weight is unpacked from those tiles, as before from tinygemm's.
    """

    MANY_ROWS = 256

    def __init__(self, weight: torch.Tensor, group_size: int):
        super().__init__(*weight.shape)
        if self.in_features % group_size:
            raise ValueError(f"in_features {self.in_features} is not a multiple of the group size {group_size}")
        self.group_size = group_size
        self.act_dtype = _kernel_dtype(weight.device, weight.dtype)
        q, scale, zero = quantize_int4(weight, group_size, self.act_dtype)
        self.use_kernel = False
        self.dequant_many_rows = False  # MANY_ROWS rows or more: a bfloat16 weight per call (CPU)
        self.qdot_kernels = None  # set by prepare_for_cpu when qweight holds qdot.pack_q4's tiles
        self.register_buffer("qweight", pack_nibbles(q))  # replaced by the kernel's layout below
        # [in / group, out, 2]: tinygemm's scale-and-zero layout, which the fallback reads too.
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
                             .to(self.act_dtype))
        if weight.device.type == "cpu":
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            except (RuntimeError, NotImplementedError) as e:
                log.info("int4: no CPU int4 pack (%s); dequantising per matmul", e)
            else:
                plain = self.qweight
                self.qweight = packed
                self.use_kernel = _try_kernel(self, self._kernel, dequantize_int4(q, scale, zero, group_size))
                if not self.use_kernel:
                    self.qweight = plain
                else:
                    self.dequant_many_rows = (
                        torch.ops.mkldnn._is_mkldnn_bf16_supported() and self.out_features % CPU_PACK_ROWS == 0
                        and torch.equal(unpack_cpu_int4(packed, *weight.shape), q))

    @staticmethod
    def fake_quant(weight: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_int4(*quantize_int4(weight, group_size, dtype), group_size)

    def prepare_for_cpu(self, parts: int, kernels) -> None:
        if (not qdot.supports(kernels, 4) or self.qdot_kernels is not None
                or self.qweight.device.type != "cpu" or self.group_size % qdot.QK
                or not qdot.fits(self.out_features, self.in_features)):
            return
        if self.dequant_many_rows:  # (the kernel's layout, checked to unpack exactly)
            q = unpack_cpu_int4(self.qweight, self.out_features, self.in_features)
        else:
            q = torch.nan_to_num(self._plain_q())  # (a group of one value has scale 0: any q)
        s, z = self.scales_zeros.float().transpose(0, 1).unbind(-1)  # [out, in / group]
        if not qdot.f16_exact_enough(s, z - 8 * s):
            log.info("int4: scales outside float16's range; this layer keeps torch's kernel")
            return
        per = self.group_size // qdot.QK
        self.qweight = qdot.pack_q4(q, s.repeat_interleave(per, 1), (z - 8 * s).repeat_interleave(per, 1))
        self.scales_zeros = None
        self.use_kernel = False  # (dequant_many_rows stays: from MANY_ROWS rows bfloat16 is faster still)
        self.qdot_kernels = kernels

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.act_dtype), self.qweight, self.group_size, self.scales_zeros
        )

    def _plain_q(self) -> torch.Tensor:
        if not self.use_kernel:
            return unpack_nibbles(self.qweight)
        # The kernel's layout is opaque: recover q by running the kernel on the identity's columns.
        eye = torch.eye(self.in_features, dtype=self.act_dtype, device=self.qweight.device)
        w = self._kernel(eye).float().t()  # [out, in], = (q - 8) * scale + zero
        s, z = self.scales_zeros.float().transpose(0, 1).unbind(-1)  # [out, in / group]
        g = w.reshape(self.out_features, -1, self.group_size)
        return torch.round((g - z[..., None]) / s[..., None] + 8).clamp(0, 15).reshape(w.shape)

    def dequantize(self) -> torch.Tensor:
        if self.qdot_kernels is not None:
            return qdot.dequantize(self.qweight, 4, self.out_features, self.in_features)
        s, z = self.scales_zeros.float().transpose(0, 1).unbind(-1)
        return dequantize_int4(self._plain_q(), s, z, self.group_size)

    def _bf16_weight(self) -> torch.Tensor:
        """The weight in bfloat16, ``(q - 8) * scale + zero`` from the kernel's packed layout, or
        from qdot's tiles in the same form (the zero point as ``m + 8 d``)."""
        if self.qdot_kernels is not None:  # (q d + m, the tiles' own form, cancels in bfloat16)
            q, d, m = qdot.unpack_q4(self.qweight, self.out_features, self.in_features)
            bf16, z = torch.bfloat16, (m + 8 * d).to(torch.bfloat16)  # the zero point (float16-rounded m)
            groups = q.view(self.out_features, -1, qdot.QK).to(bf16) - 8
            return (groups * d[..., None].to(bf16) + z[..., None]).view(self.out_features, self.in_features)
        q = unpack_cpu_int4(self.qweight, self.out_features, self.in_features)
        groups = q.view(self.out_features, -1, self.group_size).to(torch.bfloat16)
        scale, zero = self.scales_zeros.transpose(0, 1).unbind(-1)  # [out, in / group], bfloat16
        return ((groups - 8) * scale[..., None] + zero[..., None]).view(self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequant_many_rows and x.shape[0] >= self.MANY_ROWS:
            return F.linear(x.to(torch.bfloat16), self._bf16_weight()).to(x.dtype)
        if self.qdot_kernels is not None:
            return qdot.matmul(self.qdot_kernels, 4, self.qweight, x, self.out_features)
        if self.use_kernel:
            return self._kernel(x.contiguous()).to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype))


# ---- bf16 ---------------------------------------------------------------------------------


class BF16Linear(QuantLinear):
    """bfloat16 weights in a float32 model: half the bytes of W, the matmuls in bfloat16.

    One to ``few_rows`` rows (decode): the C kernels widen each weight to float32 as they stream
    it, so decode reads half the bytes and keeps float32 arithmetic. More rows: the activations
    are rounded to bfloat16 and oneDNN multiplies them by the packed weight (bf16 dot products on
    processors that have them: twice float32's rate), the result widened back to float32 (an MLP
    keeps its gate_up product in bfloat16 for SwiGLU and the down projection: ``product_bf16``).
    Norms, the softmax, the KV cache and the residual stream stay float32 (on those processors
    prefill attention's products run in bfloat16 too: ``model.bf16_matmuls``, ``CpuPagedAttention``).
    Where the C kernels stop is measured per machine, as for float32 (``cpu_measured``): on 2 AMX
    Xeon cores 8 rows, against the 4 that a Zen 4 had given (``FEW_ROWS``, the default). Where the
    processor has AMX tiles, past the C kernels and up to ``cpu_kernels.AMX_ROWS`` rows the weight
    packed into tiles once (``amx``) is multiplied by a kernel of ours that streams it at the memory's
    rate (decode steps of 16-64 requests; oneDNN's AMX kernels read it ~1.5x slower there). Past
    those rows, a second kernel of ours runs the rows past each thread's half of the tiles
    (``amx_gemm_bf16_many``, prefill steps) up to ``amx_rows``, which the model measures per shape on
    the machine (``cpu_measured.amx_rows_for``): oneDNN kept one of 2 AMX Xeon cores idle at many row
    counts (SmolLM2's o and down projections at 384-768 rows), and led only on its widest shape and
    from ~1,536 rows.
    Where the processor has bf16 dot products but no AMX tiles (a Zen 4 EPYC), the weight is packed in the
    tiles' layout all the same (``dp``) and from one row up to ``dp_rows`` (at least ``DP_ROWS``, past that
    measured per shape against oneDNN: ``cpu_measured.dp_rows_for``) go through a kernel of ours on vdpbf16ps
    (``cpu_kernels.dp_gemm``) that streams it at the memory's rate: SmolLM2's 30 layers and head (268 MB) at
    1 row in 9.0 ms against 13.8 through the widening kernel and 14.8 through oneDNN, at 8 rows 11.1 against
    14.9 (oneDNN) on 2 Zen 4 cores. Those rows are then rounded to bfloat16 as oneDNN's are (``few_rows`` 0:
    no widening kernel), so a request's products round alike in a batch of any size.
    """

    FEW_ROWS = 4
    # the rows bf16 dot products take at least: a decode step's rows stream the weights from memory, where the kernel
    # leads oneDNN 1.1-1.6x up to 64 rows (SmolLM2's 30 layers and head), which a race of one layer's weight (in
    # cache) does not show: timed so, single shapes gave 1 row one time and 512 another; the race decides past it
    DP_ROWS = 32
    # oneDNN builds (and keeps) a kernel per row count: unpadded, a server grew by 0.6-0.85 MiB per
    # shape for every step size it met (336 MiB for 100 row counts of SmolLM2's four body shapes; up to
    # 2,048 of them). Above EXACT_ROWS the rows are padded to the float32 path's buckets
    # (``model.Linear.padded_rows``); up to it each count keeps its own kernel (~70 MiB for SmolLM2's four
    # body shapes at 0.63 MiB each), as decode batches are: padding 5 rows to 16 cost 0.18 ms a layer,
    # ~20% of a decode step (2 Zen 4 cores).
    EXACT_ROWS = 32

    def __init__(self, weight: torch.Tensor):
        super().__init__(*weight.shape)
        self.register_buffer("qweight", weight.detach().to(torch.bfloat16).contiguous())
        self.kernels = None
        self.packed = None
        self.amx = None  # the weight in AMX's tiles (cpu_kernels.amx_pack), where the processor has them
        # up to this many rows, the tiles (past the C kernels' few_rows): AMX_ROWS, or more where measured
        # faster than oneDNN for this shape on this machine (the model sets it: cpu_measured.amx_rows_for)
        self.amx_rows = None
        # a fused gate_up's: up to this many rows SwiGLU goes in the AMX kernel's stores (swiglu_bf16;
        # the model measures it: cpu_measured.swiglu_rows_for); None: never
        self.swiglu_rows = None
        self.few_rows = self.FEW_ROWS  # up to this many rows, the C kernels (the model sets it: cpu_measured)
        self.dp = None  # the weight for bf16 dot products where there are no AMX tiles (cpu_kernels.dp_pack)
        self.dp_rows = self.DP_ROWS  # up to this many rows, the dot products (the model sets it: cpu_measured)
        if weight.device.type == "cpu":
            self.kernels = cpu_kernels.load_kernels()
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.qweight, None)
            if self.kernels is not None:
                self.amx = cpu_kernels.amx_pack(self.kernels, self.qweight)
                self.dp = cpu_kernels.dp_pack(self.kernels, self.qweight) if self.amx is None else None
                if self.dp is not None:
                    self.few_rows = 0

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.few_rows and self.kernels is not None and x.dtype == torch.float32 and x.is_contiguous():
            return self.c_rows(x)
        return self.many_rows(x)

    def c_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 ``x W^T`` through the C kernels (a few contiguous float32 rows)."""
        return cpu_kernels.gemm_rows(self.kernels, self.qweight, x)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` in bfloat16 products (AMX tiles or bf16 dot products up to their rows, oneDNN's where the
        weight is packed), in ``x``'s dtype."""
        out = self._ours(x, x.dtype)
        if out is not None:
            return out
        xb = x.to(torch.bfloat16)
        if self.packed is not None:
            return onednn_linear(xb, self.packed, self.padded_rows).to(x.dtype)
        return F.linear(xb, self.qweight).to(x.dtype)

    def takes_bf16(self, rows: int) -> bool:
        """Whether ``product_bf16`` multiplies ``rows`` rows, rounding a float32 input to bfloat16 first
        (which an input already in bfloat16, rounded so, skips)."""
        ours = self.dp is not None and rows <= self.dp_rows
        return (self.packed is not None or ours) and rows > self.few_rows and self.input_scale is None

    def product_bf16(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x W^T`` left in bfloat16 where oneDNN or our kernels multiply ``x`` (more than ``few_rows`` rows);
        None where the layer would take another path. The same values ``matmul`` widens to float32."""
        if not self.takes_bf16(x.shape[0]):
            return None
        out = self._ours(x, torch.bfloat16)
        if out is not None or self.packed is None:  # (no oneDNN weight: the caller's float32 path)
            return out
        return onednn_linear(x.to(torch.bfloat16), self.packed, self.padded_rows)

    @property
    def tile_rows(self) -> int:
        """Up to how many rows the AMX tiles take (where the layer has them): ``amx_rows``, else AMX_ROWS."""
        return self.amx_rows or cpu_kernels.AMX_ROWS

    def swiglu_bf16(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate_up projection: SwiGLU of ``x W^T`` in bfloat16, applied as the AMX tiles are
        stored (``cpu_kernels.amx_swiglu``; the values ``silu_mul`` gives over the tiles' product), where
        ``x``'s rows are past ``few_rows`` and up to ``swiglu_rows``; else None."""
        rows = x.shape[0]
        if (self.amx is None or not self.swiglu_rows or not self.few_rows < rows <= self.swiglu_rows or x.dim() != 2
                or not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16)):
            return None
        return cpu_kernels.amx_swiglu(self.kernels, self.amx, self.out_features, x)

    def _ours(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """``x W^T`` in ``dtype`` on AMX tiles, or through bf16 dot products, or None where neither takes ``x``
        (no tiles or dot products here, more than ``tile_rows`` or ``dp_rows`` rows, a dtype or layout the
        kernels do not read)."""
        if (x.dim() != 2 or not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16)
                or dtype not in (torch.float32, torch.bfloat16)):
            return None
        if self.amx is not None and x.shape[0] <= self.tile_rows:
            return cpu_kernels.amx_gemm(self.kernels, self.amx, self.out_features, x, dtype)
        if self.dp is not None and x.shape[0] <= self.dp_rows:
            return cpu_kernels.dp_gemm(self.kernels, self.dp, self.out_features, x, dtype)
        return None

    @property
    def path(self) -> str:
        """What multiplies past ``few_rows`` rows."""
        path = "onednn bf16" if self.packed is not None else "torch bf16"
        if self.dp is not None:
            return f"bf16 dot products to {self.dp_rows} rows, then {path}"
        return path if self.amx is None else f"amx bf16 to {self.tile_rows} rows, then {path}"

    @classmethod
    def padded_rows(cls, rows: int) -> int:
        """The row count oneDNN computes for ``rows`` rows."""
        return rows if rows <= cls.EXACT_ROWS else Linear.padded_rows(rows)

    @property
    def onednn_rows(self) -> int | None:
        """From how many rows oneDNN multiplies (the warm-up builds each count's kernel); None: never."""
        if self.packed is None:
            return None
        return max(self.few_rows, self.tile_rows if self.amx is not None else 0,
                   self.dp_rows if self.dp is not None else 0) + 1


# ---- fp8 ----------------------------------------------------------------------------------


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with a float32 scale per row (``[out, 1]``) or per tensor (``[]``): ``w ~ q * scale``."""
    amax = w.float().abs().amax(dim=1, keepdim=True) if per_channel else w.float().abs().amax()
    scale = amax.clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def fp8_supported(device: torch.device) -> bool:
    """CUDA with FP8 tensor cores (compute capability 8.9: Ada, Hopper and newer)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(QuantLinear):
    """FP8 weights and dynamically quantised FP8 activations through ``torch._scaled_mm``.

    Per-tensor scales: one for the weight, one per call for the activation (any output dtype).
    Per-channel: a scale per weight row and per activation row ("rowwise"; bf16 output).
    """

    def __init__(self, weight: torch.Tensor, per_channel: bool = False):
        super().__init__(*weight.shape)
        if not fp8_supported(weight.device):
            raise RuntimeError("fp8 needs a CUDA GPU with FP8 support (compute capability 8.9+)")
        self.per_channel = per_channel
        q, scale = quantize_fp8(weight, per_channel)
        self.register_buffer("qweight", q.contiguous())  # [out, in]; .t() is the column-major mat2
        self.register_buffer("scale", scale.reshape(1, -1) if per_channel else scale)

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scale.reshape(-1, 1) if self.per_channel else self.scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_fp8(x, self.per_channel)  # rowwise for x is per token: [T, 1]
        out_dtype = torch.bfloat16 if self.per_channel else x.dtype
        out = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=out_dtype)
        return out.to(x.dtype)
