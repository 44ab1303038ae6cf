"""The Llama family (RMSNorm, RoPE with Llama-3 scaling, GQA, SwiGLU, tied or untied embeddings).

The model works on a flattened batch: ``input_ids`` and ``positions`` of shape ``[T]`` hold the
step's tokens of every request; attention reads and writes the paged KV cache as the
``AttentionMetadata`` says. Projections are fused (qkv, gate_up) so each layer runs few, large
matmuls. Parameter names follow Hugging Face's, with the fused ones split at load.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import cpu_kernels, cpu_measured
from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig, RopeScaling
from pdserve.engine.cpu_kernels import usable


class Linear(nn.Module):
    """``y = x W^T`` (no bias), W of shape ``[out, in]`` as in Hugging Face checkpoints.

    On CPU (after ``prepare_for_cpu``, with the path ``cpu_isa`` chose for this processor): up to
    ``few_rows`` rows (measured per machine: ``cpu_measured``; one row is single-request decode)
    through a C kernel that streams W once for all of them, split across threads, in register
    tiles of 4 rows of W by 4 rows of x (csrc/cpu_kernels.c ``gemm_rows``). More rows: with the ``onednn`` path,
    oneDNN with W packed once into its blocked layout (``_linear_pointwise``); with ``mkl``, up to
    ``SPLIT_MAX_ROWS`` rows W's rows are split into one contiguous half per thread and ``bmm``
    runs one single-threaded GEMM each (10-40% faster than one multi-threaded ``mm`` on 2 AVX2
    cores), larger batches one ``mm``. See benchmarks/cpu_matmul.py.
    """

    SPLIT_MAX_ROWS = 512
    # The oneDNN path pads the rows up to a multiple of this: oneDNN builds (and keeps) a primitive per
    # shape, and a serving engine's steps bring every row count up to the token budget. Unpadded, one
    # projection called twice with each of 600 row counts grew the process by over a GiB, still growing;
    # in buckets of 16 by under 100 MiB, flat once each bucket was seen. The rows' outputs are bitwise
    # those of the unpadded call (benchmarks/onednn_shapes.py; tests/engine/test_cpu_isa.py).
    ROW_BUCKET = 16
    # From WIDEN_FROM rows the buckets widen so that there are this many per doubling of the rows (64
    # rows wide from 1,024, 128 from 2,048: at most 1/16 of a step's rows are padding): 2,048 tokens'
    # 128 buckets of 16 become 80. 0: every bucket ROW_BUCKET wide. Below 1,024 they stay 16 wide: a
    # served step is often one 512-token prompt chunk with the decoding requests' rows beside it, and
    # oneDNN's time follows the padded rows: beside 4 decoding requests such a step took 56-58 ms more
    # than the prompt alone padded to 544 rows (buckets of 32 from 512), 31-32 ms more padded to 528
    # (the engine, 2 threads, AMD EPYC Zen 4, two runs each, interleaved).
    BUCKETS_PER_DOUBLING = 16
    WIDEN_FROM = 1024
    # The start-up warm-up builds the buckets up to this many rows; larger ones are built by the first
    # step that brings them. Building a bucket's kernels costs about the same at any row count (1-3.5 ms
    # for the default model's four body shapes, 225 ms for all 80 buckets up to 2,048 rows), but running
    # a bucket's GEMMs to build them costs its rows: warming all 80 took 2.4 s of a 4.5 s start
    # on 2 Zen 4 cores, those up to 512 rows 0.4 s. Below 512 rows a first build is up to 2.3x a call (a
    # decode step's projections), above it at most 15% of the call and under 1% of the step.
    WARM_MAX_ROWS = 512

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.parts = 1
        self.kernels = None
        self.few_rows = 8  # up to this many rows, the C kernel (the model sets it: cpu_measured)
        self.path = "mkl"
        self._packed: tuple[torch.Tensor, tuple[int, int]] | None = None  # W in oneDNN's layout, and of which W

    @classmethod
    def padded_rows(cls, rows: int) -> int:
        """The row count the oneDNN path computes for ``rows`` rows (the bucket's upper end)."""
        step = cls.ROW_BUCKET
        if cls.BUCKETS_PER_DOUBLING and rows >= cls.WIDEN_FROM:
            step = max(step, (1 << (rows.bit_length() - 1)) // cls.BUCKETS_PER_DOUBLING)
        return -(-rows // step) * step

    def prepare_for_cpu(self, parts: int, kernels, path: str = "mkl", rows: int | None = None) -> None:
        """``rows``: up to how many rows the C kernel takes (None: keep the current count, 8 until the
        model sets the machine's from ``cpu_measured``)."""
        self.weight = nn.Parameter(self.weight.detach().contiguous(), requires_grad=False)
        self.parts = parts if parts > 1 and self.weight.shape[0] % parts == 0 else 1
        self.kernels = kernels if self.weight.dtype == torch.float32 else None
        self.path, self._packed = path, None
        self.few_rows = self.few_rows if rows is None else rows
        if path == "onednn":
            self.packed_weight()

    def packed_weight(self) -> torch.Tensor:
        """W in oneDNN's blocked layout, packed again if W was replaced or changed in place since
        (AWQ scales weights after load; tests swap them)."""
        key = (id(self.weight), self.weight._version)
        if self._packed is None or self._packed[1] != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None), key
        return self._packed[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def onednn_rows(self) -> int | None:
        """From how many rows oneDNN multiplies (the warm-up builds its buckets from there); None: never."""
        return self.few_rows + 1 if self.path == "onednn" and not self.weight.is_cuda else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.few_rows and self.kernels is not None and x.is_contiguous():
            return self.c_rows(x)
        return self.many_rows(x)

    def c_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` through the C kernel (a few contiguous float32 rows)."""
        return cpu_kernels.gemm_rows(self.kernels, self.weight, x)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` through the path for more than ``few_rows`` rows."""
        if self.path == "onednn" and not x.is_cuda:
            return onednn_linear(x, self.packed_weight(), self.padded_rows)
        rows = x.shape[0]
        if self.parts == 1 or rows > self.SPLIT_MAX_ROWS:
            return F.linear(x, self.weight)
        n, k = self.weight.shape
        halves = self.weight.view(self.parts, n // self.parts, k).transpose(1, 2)
        out = torch.bmm(x.expand(self.parts, rows, k), halves)  # [parts, rows, n / parts]
        return out.transpose(0, 1).reshape(rows, n)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, padded_rows: Callable[[int], int]) -> torch.Tensor:
    """``x W^T`` by oneDNN with W ``packed`` in its layout, a 2-D ``x``'s rows padded up to ``padded_rows(rows)``
    (oneDNN keeps a kernel per row count; see ``Linear.ROW_BUCKET``) and the padding cut off again."""
    rows = x.shape[0]
    pad = padded_rows(rows) - rows if x.dim() == 2 else 0
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out[:rows] if pad else out


def warm_up_projections(model: nn.Module, max_rows: int, head_rows: int, progress: bool = False) -> tuple[int, int]:
    """Run each oneDNN projection shape of ``model`` once at every row bucket a step can bring, so
    oneDNN builds (and keeps) its kernels before serving rather than under load: a step of a row
    count not met before paid for building them, and the process grew by about 0.55 MiB per bucket
    and shape until every bucket was seen (a worker started mid-run grew for the rest of it).
    ``max_rows``: the step's token budget; ``head_rows``: the most rows the output head computes
    in a step (the sampled rows; prompt logprobs can bring more); both capped at ``Linear.WARM_MAX_ROWS``
    (larger buckets: built by the first step that brings them). Returns (shapes, calls)."""
    from tqdm import tqdm

    max_rows, head_rows = min(max_rows, Linear.WARM_MAX_ROWS), min(head_rows, Linear.WARM_MAX_ROWS)

    head = getattr(model, "lm_head", None)
    # Every layer that multiplies through oneDNN says from how many rows (``onednn_rows``: Linear, and
    # bfloat16 weights' quant.formats.BF16Linear) and how it pads them (``padded_rows``).
    plan: dict[tuple, tuple[nn.Module, int, int]] = {}  # (module, its first oneDNN row count, the most rows)
    for module in model.modules():
        first = getattr(module, "onednn_rows", None)
        if first is None:
            continue
        key = (type(module), module.out_features, module.in_features)
        rows = head_rows if module is head else max_rows
        if key not in plan or plan[key][2] < rows:
            plan[key] = (module, first, rows)
    calls = [(module, rows) for module, first, most in plan.values()
             for rows in sorted({module.padded_rows(r) for r in range(first, most + 1)})]
    dtype = next((m.weight.dtype for m in model.modules() if isinstance(m, RMSNorm)), torch.float32)
    with torch.inference_mode():
        for module, rows in tqdm(calls, desc="building oneDNN kernels", unit="kernel", disable=not progress):
            module(torch.zeros(rows, module.in_features, dtype=dtype))
    return len(plan), len(calls)


NORM_DTYPES = (torch.float32, torch.bfloat16)  # what the C kernel reads and writes (its weight and residual: float32)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = None  # the C kernels, set by LlamaForCausalLM.prepare_for_cpu

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        """Normalise ``x`` (after adding ``residual``, returned as the new residual). ``out_dtype``
        (CPU): the norm's dtype when not x's; the C kernel then also takes a bfloat16 ``x`` beside a
        float32 residual (a bf16 model's projections: ``DecoderLayer.bf16_norms``)."""
        if x.is_cuda:  # one fused Triton kernel (norm and residual add)
            from pdserve.engine.triton_kernels import rms_norm

            return rms_norm(x, residual, self.weight, self.eps)
        out_dtype = out_dtype or x.dtype
        if (self.kernels is not None and x.dtype in NORM_DTYPES and out_dtype in NORM_DTYPES and x.is_cpu
                and x.is_contiguous() and usable(self.weight, *([] if residual is None else [residual]))):
            return cpu_kernels.rms_norm(self.kernels, x, residual, self.weight, self.eps, out_dtype)
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps).to(out_dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs ``(x[2i], x[2i+1])``, as a complex multiplication.

    The q/k projection rows are kept in that interleaved order (Meta's and GGUF's layout; the
    loader permutes Hugging Face's rotate-half order into it). Attention scores are unchanged
    by a permutation applied to both q and k, and one complex multiply replaces the seven
    tensor ops of rotate-half.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # Built on the CPU explicitly, so a model constructed on the meta device still gets its table.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotations of the step's positions, ``[T, 1, head_dim / 2]`` complex."""
        return self.freqs_cis.index_select(0, positions).unsqueeze(1)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` (interleaved pairs)."""
    if x.is_cuda:  # one Triton kernel instead of complex temporaries
        from pdserve.engine.triton_kernels import rope

        return rope(x, rot)
    t, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(xc * rot).view(t, h, d).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.kernels = None  # the C kernels, set by LlamaForCausalLM.prepare_for_cpu
        self.bf16_qkv = False  # qkv_proj a BF16Linear (set there too): see forward
        # o_proj a BF16Linear whose product_bf16 takes a bfloat16 input as it is (set there too): a step with a
        # prompt chunk then has attention write its output in bfloat16 (see forward)
        self.bf16_out = False

    def forward(self, x, rot, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        # bf16 weights: past the C kernels' rows the projection's bfloat16 product goes to the RoPE kernel,
        # which widens it as it rotates (no float32 copy of it first)
        qkv = self.qkv_proj.product_bf16(x) if self.bf16_qkv else None
        if qkv is None:
            qkv = self.qkv_proj(x)
        t, qk_size = qkv.shape[0], self.q_size + self.kv_size
        if self.kernels is not None and qkv.is_contiguous() and rot.is_contiguous() and qkv.dtype in (
                torch.float32, torch.bfloat16):
            qkv = cpu_kernels.rope_qkv(self.kernels, qkv, rot, self.num_heads + self.num_kv_heads, self.head_dim)
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, self.head_dim)
            v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
            # a bfloat16 x (DecoderLayer.bf16_norms): the product goes back in bfloat16 as well, and its input
            # comes in bfloat16 from attention where o_proj rounds it so (the values o_proj's own rounding gives;
            # written at half the bytes: a 4 x 512-token step on 2 AMX Xeon cores ~5% faster)
            narrow = x.dtype is torch.bfloat16 and self.bf16_qkv
            out_dtype = torch.bfloat16 if narrow and self.bf16_out and self.o_proj.takes_bf16(t) else None
            out = backend.forward(q, k, v, k_cache, v_cache, meta, out_dtype=out_dtype).reshape(-1, self.q_size)
            product = self.o_proj.product_bf16(out) if narrow else None
            return product if product is not None else self.o_proj(out)
        # q and k sit side by side in qkv: rotate them in one go.
        qk = apply_rope(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), rot)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.kernels = None  # the C kernels, set by LlamaForCausalLM.prepare_for_cpu
        self.bf16_swiglu = False  # both projections BF16Linear (set there too): see forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_swiglu:
            # bf16 weights (quantization bf16): past the C kernels' rows, gate_up's bfloat16 product goes
            # through SwiGLU into the down projection without being widened to float32 and rounded back;
            # where measured faster (AMX tiles), SwiGLU is applied as the product's tiles are stored
            h = self.gate_up_proj.swiglu_bf16(x)
            if h is None:
                gate_up = self.gate_up_proj.product_bf16(x)
                h = cpu_kernels.silu_mul(self.kernels, gate_up) if gate_up is not None else None
            if h is not None:
                down = self.down_proj.product_bf16(h)
                return down.to(x.dtype) if down is not None else self.down_proj(h.to(x.dtype))
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and usable(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(self.kernels, gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.bf16_norms = False  # every projection a BF16Linear and the C kernels there (prepare_for_cpu)

    def forward(self, x, residual, rot, k_cache, v_cache, meta, backend):
        # bf16 weights past the C kernels' rows: the norms hand the projections bfloat16 and take their
        # bfloat16 products back (the values casts around float32 norms would give, without the casts:
        # a 4 x 512-token prefill step on 2 AMX Xeon cores 500-514 -> 440-453 ms); x may then come in bfloat16
        narrow = torch.bfloat16 if self.bf16_norms and x.shape[0] > self.self_attn.qkv_proj.few_rows else None
        if residual is None:
            residual = x
            h = self.input_layernorm(x, out_dtype=narrow)
        else:
            h, residual = self.input_layernorm(x, residual, out_dtype=narrow)
        h = self.self_attn(h, rot, k_cache, v_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual, out_dtype=narrow)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        # True after quantization bf16: the projections multiply in bfloat16, so attention's products may too
        self.bf16_matmuls = False
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        # An explicit (uninitialised) weight: the default init costs seconds on the meta device.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def prepare_for_cpu(self, threads: int, linear_path: str = "mkl") -> None:
        """Lay the projections out for CPU matmuls (see ``Linear``; ``linear_path`` from
        ``cpu_isa``) and use the C kernels for norms and SwiGLU where they can be built; call
        once after loading."""
        # the activations' dtype (the norms'): a bf16 embedding table under float32 activations still takes them
        from pdserve.engine.quant.formats import BF16Linear, QuantLinear

        kernels = cpu_kernels.load_kernels() if self.norm.weight.dtype == torch.float32 else None
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare_for_cpu(threads, kernels, linear_path)
            elif isinstance(module, QuantLinear):  # (GGUF blocks multiply through kernels of their own)
                module.prepare_for_cpu(threads, kernels)
            elif isinstance(module, (RMSNorm, MLP, Attention)):
                module.kernels = kernels
                if isinstance(module, MLP):
                    module.bf16_swiglu = kernels is not None and all(
                        isinstance(p, BF16Linear) for p in (module.gate_up_proj, module.down_proj))
                elif isinstance(module, Attention):
                    module.bf16_qkv = kernels is not None and isinstance(module.qkv_proj, BF16Linear)
                    module.bf16_out = module.bf16_qkv and isinstance(module.o_proj, BF16Linear)
        for layer in self.layers:
            if type(layer) is DecoderLayer:
                attn, mlp = layer.self_attn, layer.mlp
                layer.bf16_norms = attn.bf16_qkv and isinstance(attn.o_proj, BF16Linear) and mlp.bf16_swiglu
        if self.config.tie_word_embeddings and isinstance(self.lm_head, Linear):  # (a bf16 head has its own copy)
            self.embed_tokens.weight = self.lm_head.weight

    def choose_few_rows(self, threads: int) -> None:
        """Up to how many rows the float32 projections, and bfloat16 ones (quantization bf16), go
        through the C kernel, and bfloat16 ones through the AMX kernels where the processor has them, or
        through bf16 dot products where it has those but no tiles: this machine's answer for each
        (``cpu_measured``, measured once per machine); call after ``prepare_for_cpu``."""
        from pdserve.engine.quant.formats import BF16Linear  # (formats builds on this module)

        def measured(kind: type, path_too: bool) -> None:
            # (a bf16 projection with bf16 dot products has no widening kernel rows: dp_rows below)
            layer = [m for m in self.layers[0].modules() if type(m) is kind and m.kernels is not None
                     and (not path_too or m.packed is not None and m.dp is None)]
            if layer:
                rows = cpu_measured.few_rows_for(layer, threads)
                for module in self.modules():
                    if type(module) is kind and getattr(module, "dp", None) is None:
                        module.few_rows = rows

        measured(Linear, path_too=False)  # quantized projections have kernels of their own, but bf16's:
        measured(BF16Linear, path_too=True)  # (a bf16 weight that oneDNN cannot take: the C kernel to FEW_ROWS)
        # bf16 projections on AMX tiles: up to how many rows, measured once per shape of the layers' projections
        # (the head keeps AMX_ROWS), and a gate_up's fused SwiGLU
        from pdserve.engine.cpu_kernels import AMX_ROWS

        answers: dict[tuple, int] = {}

        def per_shape(what: str, module, measure) -> int:
            key = (what, module.out_features, module.in_features)
            if key not in answers:
                answers[key] = measure(module, threads)
            return answers[key]

        for module in self.modules():  # bf16 dot products (no AMX tiles): up to how many rows, per shape, the head too
            if type(module) is BF16Linear and module.dp is not None and module.packed is not None:
                module.dp_rows = max(BF16Linear.DP_ROWS, per_shape("dp", module, cpu_measured.dp_rows_for))
        for layer in self.layers:
            for module in layer.modules():
                if type(module) is BF16Linear and module.amx is not None and module.packed is not None:
                    module.amx_rows = max(AMX_ROWS, per_shape("amx", module, cpu_measured.amx_rows_for))
            mlp = getattr(layer, "mlp", None)
            gate_up = mlp.gate_up_proj if isinstance(mlp, MLP) and mlp.bf16_swiglu else None
            if gate_up is not None and gate_up.amx is not None and gate_up.packed is not None:
                gate_up.swiglu_rows = per_shape("swiglu", gate_up, cpu_measured.swiglu_rows_for) or None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens.weight)
        dtype = self.norm.weight.dtype  # a bf16 table under float32 activations (quantization bf16): widened
        return x if x.dtype == dtype else x.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm.

        ``layer_done(i)`` is called once layer ``i`` has written this step's keys and values
        (KV export starts shipping a layer while the next ones compute).
        """
        x = self.embed(input_ids)
        rot = self.rope(positions)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, rot, k_cache, v_cache, meta, backend)
            if layer_done is not None:
                layer_done(i)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
