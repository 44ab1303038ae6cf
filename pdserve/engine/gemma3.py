"""Gemma 3 (text): the Llama model's parts with Gemma's differences.

What differs from ``model.LlamaForCausalLM``, as transformers' ``Gemma3ForCausalLM`` has it:

- sliding-window layers: layer ``i`` attends to the last ``sliding_window`` positions (its own
  included) unless it is a global layer (``config.layer_types``; every sixth by default), and the
  two kinds have their own RoPE bases (``rope_local_theta`` for the local ones);
- RMSNorm of q and k per head before RoPE, and four norms per layer: before and after attention,
  before and after the MLP (each after-norm applied before the residual add);
- norm weights ``1 + w`` (GGUF files store them with the 1 added, Hugging Face's without);
- the embedding scaled by ``sqrt(hidden_size)``; a GELU (tanh) MLP;
- attention scaled by ``query_pre_attn_scalar ** -0.5``.

The attention of a sliding-window layer reads only its window's blocks. Which blocks the cache
keeps is the KV cache manager's: every block of every layer with one block table, or, with layer
groups (``HybridKVCacheManager``), only the window's blocks for the local layers; ``meta`` is then
a ``GroupedMetadata`` with each group's block ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata, GroupedMetadata, windowed
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import MLP, Attention, Linear, LlamaForCausalLM, RMSNorm, RotaryEmbedding, apply_rope


class GemmaAttention(Attention):
    """Llama's projections, with q and k normalised per head before RoPE."""

    def __init__(self, cfg: ModelConfig, sliding: bool):
        super().__init__(cfg)
        self.sliding = sliding
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # The backends scale by head_dim ** -0.5; Gemma's own scale, where it differs, goes into q.
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_scale = None if scalar == cfg.head_dim else (cfg.head_dim / scalar) ** 0.5

    def forward(self, x, rot, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        t, qk_size = qkv.shape[0], self.q_size + self.kv_size
        q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_dim))  # per head: rows of head_dim
        k = self.k_norm(qkv[:, self.q_size : qk_size].reshape(-1, self.head_dim))
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), rot)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), rot)
        if self.q_scale is not None:
            q = q * self.q_scale
        v = qkv[:, qk_size:].reshape(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class GemmaMLP(MLP):
    """GELU (tanh) in place of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sliding = sliding
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = GemmaAttention(cfg, sliding)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(self, x, rot, k_cache, v_cache, meta, backend):
        h = self.self_attn(self.input_layernorm(x), rot, k_cache, v_cache, meta, backend)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Same interface as ``LlamaForCausalLM`` (the runner, quantization and KV export use it as one)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        nn.Module.__init__(self)
        self.config = cfg
        self.bf16_matmuls = False  # as LlamaForCausalLM's
        positions = max_positions or cfg.max_position_embeddings
        self.rope = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling)  # global layers
        self.rope_local = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_local_theta, None)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        # sqrt(hidden) as a float32 number, then in the activations' dtype (transformers' order)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, device="cpu"), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, cfg.is_sliding(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * self.embed_scale.to(device=x.device, dtype=x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | GroupedMetadata,
        backend: AttentionBackend,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm (see ``LlamaForCausalLM.forward``)."""
        x = self.embed(input_ids)
        rot_global, rot_local = self.rope(positions), self.rope_local(positions)
        views: dict[tuple[int, bool], AttentionMetadata] = {}  # (group, sliding) -> the layer's metadata
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            group = meta.layer_group[i] if isinstance(meta, GroupedMetadata) else 0
            layer_meta = views.get((group, layer.sliding))
            if layer_meta is None:
                layer_meta = meta.groups[group] if isinstance(meta, GroupedMetadata) else meta
                if layer.sliding:
                    layer_meta = windowed(layer_meta, self.config.sliding_window)
                views[group, layer.sliding] = layer_meta
            x = layer(x, rot_local if layer.sliding else rot_global, k_cache, v_cache, layer_meta, backend)
            if layer_done is not None:
                layer_done(i)
        return x
