"""Loading a model: GGUF files, Hugging Face folders, random weights (specs: see sources.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.configs import ConfigError
from pdserve.engine.config import DEFAULT_MODEL, ModelConfig, RopeScaling, gemma3_layer_types
from pdserve.engine.gguf_file import GGUFFile
from pdserve.engine.model import LlamaForCausalLM, RotaryEmbedding
from pdserve.engine.quant import check_quantization, quantize_model
from pdserve.engine.sources import ModelSource, resolve_model
from pdserve.engine.tokenizer import ModelTokenizer, load_tokenizer


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: ModelTokenizer
    config: ModelConfig
    source: ModelSource
    load_seconds: float
    fingerprint: str = ""  # the shape, the weights' origin and the seed: workers exchanging KV must agree


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    seed: int = 0,
    progress: bool = True,
    quantization: str = "none",
    quantization_group_size: int = 32,
    linear_path: str | None = None,
) -> LoadedModel:
    """``linear_path``: how float projections of many rows run on a CPU (see model.Linear and
    cpu_isa.CpuPlan.linear_path; None: what this processor's best ISA implies)."""
    start = time.perf_counter()
    if linear_path is None:
        from pdserve.engine.cpu_isa import select_isa

        linear_path = select_isa("auto").linear_path_for(dtype)
    source = resolve_model(spec)
    check_quantization(quantization, source.kind, device)
    if source.kind == "gguf":
        cfg, weights, tokenizer = _read_gguf(source.path, progress)
    elif source.kind == "hf":
        cfg, weights, tokenizer = _read_hf(source.path, progress)
    else:
        cfg, weights = source.shape, None
        tokenizer = _default_tokenizer()
    model = build_model(cfg, weights, dtype, device, max_positions, seed)
    del weights  # the float copies go before the quantized ones are built
    quantize_model(model, quantization, quantization_group_size, source.path, tokenizer)
    if next(model.parameters()).device.type == "cpu":
        # Again after quantization (build_model prepared the float layers for "mkl"): the path's
        # packing for the float layers left, the kernels for the quantized ones (gguf's blocks).
        model.prepare_for_cpu(torch.get_num_threads(), linear_path)
        model.choose_few_rows(torch.get_num_threads())
    fingerprint = _fingerprint(source, cfg, seed, f"{quantization}/{quantization_group_size}")
    return LoadedModel(model, tokenizer, cfg, source, time.perf_counter() - start, fingerprint)


def _fingerprint(source: ModelSource, cfg: ModelConfig, seed: int, quantization: str = "none/64") -> str:
    import hashlib

    origin = source.name
    if source.path is not None:
        files = [source.path] if source.path.is_file() else sorted(source.path.glob("*.safetensors"))
        origin += ":" + ",".join(f"{f.name}={f.stat().st_size}" for f in files)
    elif source.kind == "random":
        origin += f":seed={seed}"
    if not quantization.startswith("none/"):  # quantized weights give other KV: workers must not mix them
        origin += f"|quantization={quantization}"
    return hashlib.sha256(f"{cfg.fingerprint()}|{origin}".encode()).hexdigest()[:16]


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor] | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    seed: int = 0,
) -> LlamaForCausalLM:
    """The model with the given weights (our parameter names), or random ones if None."""
    max_positions = max_positions or cfg.max_position_embeddings
    if weights is None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_class(cfg)(cfg, max_positions)
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "_norm.weight")) or name == "norm.weight":
                p.data.normal_(1.0, 0.1)  # not all ones, so norm weights matter in comparisons
            else:
                p.data.normal_(0.0, 0.02)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        _tables_to(model, device)
        return _finish(model)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions)
    if cfg.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights["embed_tokens.weight"])
    state = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    _tables_to(model, device)
    return _finish(model)


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    if cfg.architecture == "gemma3":
        from pdserve.engine.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    return LlamaForCausalLM


def _tables_to(model: LlamaForCausalLM, device) -> None:
    """The buffers built on the CPU whatever the device (RoPE tables, Gemma's embedding scale)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.to(device)
    if hasattr(model, "embed_scale"):
        model.embed_scale = model.embed_scale.to(device)


def _finish(model: LlamaForCausalLM) -> LlamaForCausalLM:
    model.eval().requires_grad_(False)
    if next(model.parameters()).device.type == "cpu":
        model.prepare_for_cpu(torch.get_num_threads())
    return model


# ---- GGUF ---------------------------------------------------------------------------------

def _read_gguf(path: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], ModelTokenizer]:
    gguf = GGUFFile(path)
    fields = gguf.fields
    arch = fields.get("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise ConfigError(f"model: {path} has architecture {arch!r}; supported: 'llama', 'gemma3'")
    cfg = _gguf_config(fields, gguf.tensors, arch)
    raw = {}
    for name in tqdm(gguf.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False):
        raw[name] = torch.from_numpy(gguf.dequantize(name))
    weights = _gguf_gemma3_to_ours(raw, cfg) if arch == "gemma3" else _gguf_to_ours(raw, cfg)
    return cfg, weights, ModelTokenizer.from_gguf_fields(fields)


def _gguf_config(fields: dict, tensors: dict, arch: str = "llama") -> ModelConfig:
    g = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    scaling = None
    if g("rope.scaling.type") == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(g("rope.scaling.factor")))
    vocab = g("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    cfg = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", g("rope.dimension_count", hidden // heads))),
        max_position_embeddings=int(g("context_length", 4096)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
    )
    if arch == "gemma3":  # what the file does not say is transformers' Gemma3TextConfig default
        cfg = dataclasses.replace(
            cfg, architecture="gemma3", sliding_window=int(g("attention.sliding_window", 4096)),
            layer_types=gemma3_layer_types(cfg.num_layers), query_pre_attn_scalar=float(cfg.head_dim),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 1000000.0)),
        )
    if "rope_freqs.weight" in tensors:
        raise ConfigError("model: GGUF files with a rope_freqs tensor (Llama 3.1 scaling) are not supported yet; "
                          "load the Hugging Face folder instead")
    return cfg


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k rows from Hugging Face's rotate-half order to interleaved pairs (GGUF's, and ours)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def halve_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse: interleaved pairs -> rotate-half order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_to_ours(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"embed_tokens.weight": raw["token_embd.weight"], "norm.weight": raw["output_norm.weight"]}
    if "output.weight" in raw:
        out["lm_head.weight"] = raw["output.weight"]
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        # GGUF already stores q/k rows in the interleaved RoPE order the model uses.
        qkv = [raw[b + "attn_q.weight"], raw[b + "attn_k.weight"], raw[b + "attn_v.weight"]]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(qkv)
        out[p + "self_attn.o_proj.weight"] = raw[b + "attn_output.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([raw[b + "ffn_gate.weight"], raw[b + "ffn_up.weight"]])
        out[p + "mlp.down_proj.weight"] = raw[b + "ffn_down.weight"]
        out[p + "input_layernorm.weight"] = raw[b + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = raw[b + "ffn_norm.weight"]
    return out


def _gguf_gemma3_to_ours(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma 3 tensors. Unlike Llama files, q/k rows are in Hugging Face's rotate-half order
    (llama.cpp runs Gemma's RoPE in NeoX style): they, and the q/k norm weights over head_dim,
    are put in our interleaved order. Norm weights are stored as ``1 + w``; they are taken as
    ``(stored - 1) + 1`` in float32, the multiplier transformers computes from the same file."""
    def norm(t: torch.Tensor) -> torch.Tensor:
        return (t.float() - 1.0) + 1.0

    out = {"embed_tokens.weight": raw["token_embd.weight"], "norm.weight": norm(raw["output_norm.weight"])}
    if "output.weight" in raw:
        out["lm_head.weight"] = raw["output.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q = interleave_rope_rows(raw[b + "attn_q.weight"], cfg.num_heads)
        k = interleave_rope_rows(raw[b + "attn_k.weight"], cfg.num_kv_heads)
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, raw[b + "attn_v.weight"]])
        out[p + "self_attn.o_proj.weight"] = raw[b + "attn_output.weight"]
        out[p + "self_attn.q_norm.weight"] = interleave_rope_rows(norm(raw[b + "attn_q_norm.weight"]), 1)
        out[p + "self_attn.k_norm.weight"] = interleave_rope_rows(norm(raw[b + "attn_k_norm.weight"]), 1)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([raw[b + "ffn_gate.weight"], raw[b + "ffn_up.weight"]])
        out[p + "mlp.down_proj.weight"] = raw[b + "ffn_down.weight"]
        for ours, theirs in names.items():
            out[p + ours + ".weight"] = norm(raw[b + theirs + ".weight"])
    return out


# ---- Hugging Face folders -----------------------------------------------------------------


def _read_hf(path: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], ModelTokenizer]:
    from safetensors import safe_open

    hf_cfg = json.loads((path / "config.json").read_text())
    archs = hf_cfg.get("architectures") or ["LlamaForCausalLM"]
    if hf_cfg.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
        raise ConfigError(f"model: {path} is a {hf_cfg.get('model_type')!r} model; only Llama is supported")
    cfg = ModelConfig.from_hf(hf_cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model: no .safetensors files in {path}")
    hf = {}
    for file in tqdm(files, desc=f"loading {path.name}", unit="file", disable=not progress, leave=False):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                hf[name] = f.get_tensor(name).float()
    return cfg, hf_to_ours(hf, cfg), load_tokenizer(str(path))


def hf_to_ours(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama parameter names -> ours (fusing q/k/v and gate/up)."""
    strip = {k.removeprefix("model."): v for k, v in hf.items()}
    out = {"embed_tokens.weight": strip["embed_tokens.weight"], "norm.weight": strip["norm.weight"]}
    if "lm_head.weight" in strip and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = strip["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        q = interleave_rope_rows(strip[a + "q_proj.weight"], cfg.num_heads)
        k = interleave_rope_rows(strip[a + "k_proj.weight"], cfg.num_kv_heads)
        out[a + "qkv_proj.weight"] = torch.cat([q, k, strip[a + "v_proj.weight"]])
        out[a + "o_proj.weight"] = strip[a + "o_proj.weight"]
        out[m + "gate_up_proj.weight"] = torch.cat([strip[m + "gate_proj.weight"], strip[m + "up_proj.weight"]])
        out[m + "down_proj.weight"] = strip[m + "down_proj.weight"]
        out[p + "input_layernorm.weight"] = strip[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = strip[p + "post_attention_layernorm.weight"]
    return out


def ours_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> Hugging Face's (splitting the fused projections)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    out["lm_head.weight"] = state.get("lm_head.weight", state["embed_tokens.weight"])
    for i in range(cfg.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        qw, kw, vw = state[p + "self_attn.qkv_proj.weight"].split([q, kv, kv])
        out[h + "self_attn.q_proj.weight"] = halve_rope_rows(qw, cfg.num_heads)
        out[h + "self_attn.k_proj.weight"] = halve_rope_rows(kw, cfg.num_kv_heads)
        out[h + "self_attn.v_proj.weight"] = vw
        out[h + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        gate, up = state[p + "mlp.gate_up_proj.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"]
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[h + n + ".weight"] = state[p + n + ".weight"]
    return out


def _default_tokenizer() -> ModelTokenizer:
    return load_tokenizer(DEFAULT_MODEL)
