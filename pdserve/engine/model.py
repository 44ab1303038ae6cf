"""The Llama family (RMSNorm, RoPE with Llama-3 scaling, GQA, SwiGLU, tied or untied embeddings).

The model works on a flattened batch: ``input_ids`` and ``positions`` of shape ``[T]`` hold the
step's tokens of every request; attention reads and writes the paged KV cache as the
``AttentionMetadata`` says. Projections are fused (qkv, gate_up) so each layer runs few, large
matmuls. Parameter names follow Hugging Face's, with the fused ones split at load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (after adding ``residual``, returned as the new residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # Built on the CPU explicitly, so a model constructed on the meta device still gets its tables.
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
    """Rotate-half RoPE (Hugging Face's convention) from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_positions = max_positions
        self._build(max_positions)

    def _build(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device="cpu"), self.inv_freq.cpu())
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, hd/2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rope = rope

    def forward(self, x, positions, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, k_cache, v_cache, meta, backend):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, k_cache, v_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, k_cache, v_cache, meta, backend)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
