"""Latency metrics of a benchmark run, from per-request timings. Pure functions.

Definitions (the same as the router's ``/metrics`` histograms, see router/metrics.py):
- TTFT: request sent -> first token-bearing chunk received.
- ITL (inter-token latency): gaps between consecutive token-bearing chunks of one request.
- TPOT (time per output token): (end-to-end latency - TTFT) / (output tokens - 1); defined
  only for outputs of two tokens or more.
- E2E: request sent -> last byte received.
- Goodput: completed requests per second that met every SLO given (TTFT <= its SLO; TPOT <=
  its SLO where TPOT is defined); SLO attainment: the fraction of requests (failed ones
  included) that completed within them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(slots=True)  # a simulation keeps a million of them: a third of the bytes, faster to reach
class RequestRecord:
    """One request's outcome; times in seconds, ``start`` relative to the run's start."""

    index: int
    start: float
    input_tokens: int
    requested_output_tokens: int
    ok: bool = False
    error: str | None = None  # kind of failure: "http_429", "connection", "timeout", "stream_error", ...
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # the server's usage count when reported, else the stream's chunks
    stream_chunks: int = 0  # token-bearing chunks counted from the stream
    usage_tokens: int | None = None  # completion_tokens the server reported
    start_wall: float = 0.0  # time.time() when sent (to compare with server-side clocks)
    text: str | None = None
    warmup: bool = False
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, as the server's usage said

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, specs: list[str] | None) -> SLO | None:
        """From ``["ttft:500", "tpot:50"]`` (milliseconds), as ``--goodput`` takes them."""
        if not specs:
            return None
        values = {}
        for spec in specs:
            name, sep, value = spec.partition(":")
            if not sep or name not in ("ttft", "tpot"):
                raise ValueError(f"--goodput: expected ttft:MS or tpot:MS, got {spec!r}")
            try:
                values[f"{name}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {spec!r} is not a number of milliseconds") from None
            if values[f"{name}_ms"] <= 0:
                raise ValueError(f"--goodput: {spec!r} must be positive")
        return cls(**values)

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > self.ttft_ms):
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def stats_ms(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 (and max) of seconds, in milliseconds; NaN when empty."""
    if not values:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "max")}
    a = np.asarray(values, dtype=float) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


@dataclass
class Summary:
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    goodput: float | None = None  # requests/s meeting the SLO
    slo_attainment: float | None = None
    usage_mismatches: int = 0  # requests whose streamed chunk count differs from the reported usage
    prefix_hit_rate: float | None = None  # cached prompt tokens / prompt tokens, of requests whose usage said

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    errors: dict[str, int] = {}
    for r in measured:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    summary = Summary(
        completed=len(ok),
        failed=len(measured) - len(ok),
        errors=errors,
        duration_s=duration_s,
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        ttft_ms=stats_ms([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=stats_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=stats_ms([x for r in ok for x in r.itl]),
        e2e_ms=stats_ms([r.latency for r in ok if r.latency is not None]),
        usage_mismatches=sum(1 for r in ok if r.usage_tokens is not None and r.usage_tokens != r.stream_chunks),
        prefix_hit_rate=prefix_hit_rate(ok),
    )
    if slo is not None:
        good = sum(1 for r in measured if slo.met(r))
        summary.goodput = good / duration_s
        summary.slo_attainment = good / len(measured) if measured else math.nan
    return summary


def prefix_hit_rate(records: list[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, of the records that report their cached tokens (None: none do;
    a server that does not report ``usage.prompt_tokens_details``)."""
    told = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.input_tokens for r in told)
    return sum(r.cached_tokens for r in told) / prompt if prompt else None


def goodput_rate(rates: list[float], attainments: list[float], target: float = 0.9) -> float | None:
    """The highest request rate whose SLO attainment reaches ``target`` (None if none does).

    Rates are taken in increasing order and the search stops at the first that misses, as
    DistServe defines it: attainment that recovers at a higher rate is noise, not capacity.
    """
    best = None
    for rate, att in sorted(zip(rates, attainments)):
        if att >= target:
            best = rate
        else:
            break
    return best
