"""The latency model `pdserve profile` writes and `pdserve sim` / `pdserve plan` read.

An engine step's time is modelled as a linear function of what the step computes:

    step_s = overhead_s
           + per_prefill_token_s   x prefill_tokens      (tokens of chunks of more than one token)
           + per_attention_pair_s  x prefill_pairs       (query-key pairs of those chunks: causal
                                                          attention over their context and themselves)
           + per_decode_seq_s      x decode_seqs         (one-token requests)
           + per_decode_context_s  x decode_context      (keys those requests read: their contexts)

and shipping a prompt's KV from a prefill to a decode worker as ``overhead_s + bytes x
s_per_byte`` per transfer backend (and what shipping it adds to a prefill worker's steps); a request's
time outside engine steps before its first token (router, dispatch, the way back) as
``request_overhead_s``. A profile is either **measured** (the real engine's steps on
some machine, least squares; `pdserve profile`) or **modelled** (a roofline from a hardware
description and a model shape, for machines not at hand; marked as such).

Profiles are JSON with a format version; a file of another version is refused with its version
named. This module is pure (no torch): the router and the simulator import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_VERSION = 1
KINDS = ("measured", "modelled")


@dataclass(frozen=True)
class StepFeatures:
    """What one engine step computes (``features_of`` derives it from a SchedulerOutput)."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    def row(self) -> tuple[float, float, float, float, float]:
        """The regression row: a 1 for the overhead, then the four counts."""
        return 1.0, float(self.prefill_tokens), float(self.prefill_pairs), float(self.decode_seqs), float(
            self.decode_context)


def chunk_pairs(context_len: int, query_len: int, window: int = 0) -> int:
    """Query-key pairs of a causal chunk: query i (0-based) at position context_len + i sees
    context_len + i + 1 keys, or ``window`` of them at most."""
    if window:
        return sum(min(context_len + i + 1, window) for i in range(query_len))
    return query_len * context_len + query_len * (query_len + 1) // 2


def features_of(scheduled: Iterable) -> StepFeatures:
    """The features of a step from its scheduled requests (``SchedulerOutput.scheduled``: items with
    ``start`` and ``num_tokens``; duck-typed, so this module does not import the engine)."""
    prefill_tokens = prefill_pairs = decode_seqs = decode_context = 0
    for item in scheduled:
        if item.num_tokens == 1:
            decode_seqs += 1
            decode_context += item.start + 1
        else:
            prefill_tokens += item.num_tokens
            prefill_pairs += chunk_pairs(item.start, item.num_tokens)
    return StepFeatures(prefill_tokens, prefill_pairs, decode_seqs, decode_context)


@dataclass(frozen=True)
class StepModel:
    """Coefficients of the step time (seconds; see the module's docstring)."""

    overhead_s: float
    per_prefill_token_s: float
    per_attention_pair_s: float
    per_decode_seq_s: float
    per_decode_context_s: float

    def step_s(self, f: StepFeatures) -> float:
        t = (self.overhead_s + self.per_prefill_token_s * f.prefill_tokens + self.per_attention_pair_s * f.prefill_pairs
             + self.per_decode_seq_s * f.decode_seqs + self.per_decode_context_s * f.decode_context)
        return max(t, 0.0)

    @classmethod
    def from_coefficients(cls, coefficients: Iterable[float]) -> StepModel:
        return cls(*[float(c) for c in coefficients])


@dataclass(frozen=True)
class TransferModel:
    """One KV transfer backend: a fixed cost per transfer and a cost per byte (wall time), and what a
    prefill worker's engine steps pay for shipping their KV.

    A prefill worker ships each layer's KV while its engine computes the next layers; the snapshots,
    serialisation, checksums and gRPC's socket work run beside the engine, on its cores where it takes
    them all (a CPU engine), and its steps take longer: ``export_step_overhead_s`` per step that ships
    KV plus ``export_step_s_per_byte`` per byte it ships (``pdserve profile`` measures the same prompts'
    steps with and without shipping their KV; SmolLM2 in float32 on one core of an AMX Xeon: 2,048 tokens
    4.95 -> 5.30 s). 0: not measured, or the engine computes elsewhere (a GPU)."""

    overhead_s: float
    s_per_byte: float
    export_step_overhead_s: float = 0.0
    export_step_s_per_byte: float = 0.0

    def transfer_s(self, num_bytes: int) -> float:
        return self.overhead_s + self.s_per_byte * num_bytes

    def export_step_s(self, num_bytes: int) -> float:
        """What a prefill worker's step that ships ``num_bytes`` of KV takes beyond the step alone."""
        return self.export_step_overhead_s + self.export_step_s_per_byte * num_bytes if num_bytes > 0 else 0.0


@dataclass(frozen=True)
class Profile:
    """A latency model with what it was measured (or modelled) on."""

    kind: str  # measured | modelled
    model: dict  # name, and the shape: layers, kv_heads, head_dim, ...; kv_bytes_per_token
    hardware: dict  # cpu model and flags / GPU name; threads; for modelled: the description used
    step: StepModel
    transfer: dict[str, TransferModel] = field(default_factory=dict)
    fit: dict = field(default_factory=dict)  # samples, r2, mean_abs_pct_error, max_abs_pct_error
    created: str = ""
    version: int = PROFILE_VERSION
    # A request's time outside engine steps before its first token: the router's handling, the dispatch
    # to a worker, the first token's way back (measured through a server: `pdserve profile --serving-url`;
    # 0: not measured). The simulator delays each request's entry into the cluster by it.
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.request_overhead_s < 0:
            raise ValueError(f"profile request_overhead_s: must not be negative, got {self.request_overhead_s}")
        if self.kind not in KINDS:
            raise ValueError(f"profile kind: {self.kind!r} is not one of {list(KINDS)}")
        if "kv_bytes_per_token" not in self.model:
            raise ValueError("profile model: kv_bytes_per_token is missing")

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.model["kv_bytes_per_token"])

    def step_s(self, f: StepFeatures) -> float:
        return self.step.step_s(f)

    def transfer_s(self, tokens: int, backend: str = "grpc") -> float:
        """Seconds to ship ``tokens`` tokens' KV over ``backend`` (a profile without it: refused)."""
        if backend not in self.transfer:
            raise KeyError(f"the profile has no transfer model for backend {backend!r} "
                           f"(it has: {sorted(self.transfer) or 'none'})")
        return self.transfer[backend].transfer_s(tokens * self.kv_bytes_per_token)

    def export_step_s(self, tokens: int, backend: str = "grpc") -> float:
        """What a prefill worker's step that ships ``tokens`` tokens' KV over ``backend`` takes beyond the step
        alone (``TransferModel``; 0 where not measured)."""
        t = self.transfer.get(backend)
        return 0.0 if t is None else t.export_step_s(tokens * self.kv_bytes_per_token)

    def ships_with_cost(self, backend: str = "grpc") -> bool:
        """Whether a step shipping KV over ``backend`` costs more than the step alone in this profile."""
        t = self.transfer.get(backend)
        return t is not None and (t.export_step_overhead_s > 0 or t.export_step_s_per_byte > 0)

    def cost_model(self, backend: str = "grpc", **overrides):
        """The router's CostModel from this profile (router/cost.py): prefill tokens/s of a
        1,024-token prompt, the one-sequence decode step and what each more sequence adds (at a
        512-token context), the transfer cost per token."""
        from pdserve.router.cost import CostModel

        prompt = 1024
        prefill_s = self.step_s(StepFeatures(prompt, chunk_pairs(0, prompt)))
        one = self.step_s(StepFeatures(decode_seqs=1, decode_context=512))
        two = self.step_s(StepFeatures(decode_seqs=2, decode_context=1024))
        values = {"prefill_tokens_per_s": prompt / prefill_s, "decode_step_s": one,
                  "decode_step_s_per_seq": max(two - one, 0.0)}
        if backend in self.transfer:
            t = self.transfer[backend]
            values["transfer_s_per_token"] = t.s_per_byte * self.kv_bytes_per_token
            values["remote_overhead_s"] = t.overhead_s
        values.update(overrides)
        return CostModel(**values)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["step"] = dataclasses.asdict(self.step)
        data["transfer"] = {k: dataclasses.asdict(v) for k, v in self.transfer.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping, source: str = "profile") -> Profile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"{source}: profile format version {version!r}; this pdserve reads version "
                             f"{PROFILE_VERSION} (write it again with `pdserve profile`)")
        try:
            step = StepModel(**data["step"])
            transfer = {k: TransferModel(**v) for k, v in data.get("transfer", {}).items()}
            return cls(kind=data["kind"], model=dict(data["model"]), hardware=dict(data["hardware"]), step=step,
                       transfer=transfer, fit=dict(data.get("fit", {})), created=data.get("created", ""),
                       version=version, request_overhead_s=float(data.get("request_overhead_s", 0.0)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: not a pdserve profile ({e})") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from e
        return cls.from_json(data, str(path))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token across every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


# ---- roofline (modelled) profiles -----------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What a roofline needs of a machine: dense matmul FLOP/s at the serving dtype, memory bandwidth,
    the network between workers, and how much of each peak a real engine reaches."""

    name: str
    flops: float  # dense FLOP/s at the weights' dtype
    memory_bytes_per_s: float
    network_bytes_per_s: float  # between a prefill and a decode worker
    dtype_bytes: int = 2
    flops_efficiency: float = 0.6  # share of peak FLOP/s a serving engine's matmuls reach
    memory_efficiency: float = 0.7
    step_overhead_s: float = 0.004  # scheduling, launches and sampling per step
    transfer_overhead_s: float = 0.002


HARDWARE: dict[str, Hardware] = {
    # Data-sheet peaks (dense bf16, no sparsity; HBM; NVLink or 400 Gb/s between nodes).
    "h100-sxm": Hardware("NVIDIA H100 SXM", 989e12, 3.35e12, 50e9),
    "h200": Hardware("NVIDIA H200", 989e12, 4.8e12, 50e9),
    "l4": Hardware("NVIDIA L4", 121e12, 300e9, 12.5e9),
    # This project's CPU machines: 2 cores of an AMD EPYC (Zen 4), float32 through oneDNN measured at
    # ~200 GFLOP/s (benchmarks/cpu_matmul.py); loopback gRPC between processes.
    "epyc-2core": Hardware("2 cores of an AMD EPYC (Zen 4), float32", 200e9, 20e9, 1e9, dtype_bytes=4,
                           flops_efficiency=0.9, memory_efficiency=0.5, step_overhead_s=0.01,
                           transfer_overhead_s=0.005),
}


def roofline(hw: Hardware, shape: Mapping, model_name: str) -> Profile:
    """A modelled profile: each term is the larger of its compute time and its memory time.

    ``shape`` holds the model's vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
    num_kv_heads, head_dim (an engine ModelConfig as a dict). Prefill tokens cost the weights'
    FLOPs (2 x parameters per token); attention pairs 4 x heads x head_dim FLOPs each; a decode
    step reads every weight once (the per-step overhead absorbs that read for batch 1; more
    sequences add their FLOPs), and each context token's KV once.
    """
    layers, hidden, inter = shape["num_layers"], shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_heads"], shape["num_kv_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    per_layer = hidden * (heads * head_dim) * 2 + hidden * (kv_heads * head_dim) * 2 + 3 * hidden * inter
    params = layers * per_layer + shape["vocab_size"] * hidden
    flops = hw.flops * hw.flops_efficiency
    bandwidth = hw.memory_bytes_per_s * hw.memory_efficiency
    kv_token = kv_bytes_per_token(layers, kv_heads, head_dim, hw.dtype_bytes)
    weight_read_s = params * hw.dtype_bytes / bandwidth
    step = StepModel(
        overhead_s=hw.step_overhead_s + weight_read_s,
        per_prefill_token_s=2 * params / flops,
        per_attention_pair_s=4 * layers * heads * head_dim / flops,
        per_decode_seq_s=2 * params / flops,
        per_decode_context_s=max(kv_token / bandwidth, 4 * layers * heads * head_dim / flops),
    )
    transfer = {"grpc": TransferModel(hw.transfer_overhead_s, 1.0 / hw.network_bytes_per_s),
                "nccl": TransferModel(hw.transfer_overhead_s / 2, 1.0 / hw.network_bytes_per_s)}
    model = {"name": model_name, **{k: shape[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_layers", "num_heads", "num_kv_heads")},
             "head_dim": head_dim, "parameters": params, "kv_bytes_per_token": kv_token}
    hardware = {**dataclasses.asdict(hw)}
    return Profile("modelled", model, hardware, step, transfer, fit={"note": "roofline: modelled, not measured"})


# ---- fitting ------------------------------------------------------------------------------


def fit_step_model(samples: list[tuple[StepFeatures, float]]) -> tuple[StepModel, dict]:
    """Least squares over (features, seconds) samples, coefficients kept non-negative (a negative
    cost per token would be an artefact of noise): terms whose unconstrained fit goes negative are
    dropped and the rest refitted. Returns the model and its fit statistics."""
    import numpy as np

    if len(samples) < 5:
        raise ValueError(f"fitting a step model needs at least 5 samples, got {len(samples)}")
    x = np.array([f.row() for f, _ in samples])
    y = np.array([t for _, t in samples])
    # Relative error is what matters (a 5 ms decode step and a 3 s prefill both count): weight
    # each sample by 1 / its time.
    w = 1.0 / np.maximum(y, 1e-6)
    active = [i for i in range(x.shape[1]) if i == 0 or x[:, i].any()]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        negative = [a for a, c in zip(active, coef) if c < 0 and a != 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda a: coef[active.index(a)]))
    full = np.zeros(x.shape[1])
    full[active] = coef
    if full[0] < 0:
        full[0] = 0.0
    model = StepModel.from_coefficients(full)
    predicted = np.array([model.step_s(f) for f, _ in samples])
    pct = np.abs(predicted - y) / np.maximum(y, 1e-9) * 100
    ss_res = float(((predicted - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or math.inf
    stats = {"samples": len(samples), "r2": 1 - ss_res / ss_tot, "mean_abs_pct_error": float(pct.mean()),
             "max_abs_pct_error": float(pct.max())}
    return model, stats
