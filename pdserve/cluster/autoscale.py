"""The autoscaling policy of a worker pool: pool signals in, desired replicas out. Pure.

    decision = policy.decide(signals, now)      # Decision(desired, raw, reason, signals)

Each pool scales on the signals that fit its role:

- prefill: queued prompt tokens per replica (``target_queued_prompt_tokens``), and TTFT p90
  against ``ttft_slo_ms``;
- decode: running requests per replica (``target_running_requests``), KV-cache use
  (``target_kv_usage``), and TPOT p90 against ``tpot_slo_ms``.

The raw recommendation is the largest replica count any signal asks for (an SLO missed asks for
one more replica than now). It is then stabilised as Kubernetes' HPA does: a scale-up takes the
smallest recommendation seen over ``upscale_window_s`` (the load must last), a scale-down the
largest over ``downscale_window_s`` (the quiet must last); then at most
``max_step`` replicas move at once, within ``[min_replicas, max_replicas]``. After a move the
windows start afresh, so a constant signal gives at most one move per window, towards its level,
and no oscillation; the same when the pool's size changed by other means (Serve's cold start from
zero, a replica restarted). With ``min_replicas: 0`` an idle pool goes to zero after the downscale window,
and a request waiting for a replica brings one back at once (no window: the cold start is the
bound, ``cold_start_timeout_s``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pdserve.configs import ConfigError, doc


@dataclass(frozen=True)
class AutoscalingConfig:
    min_replicas: int = doc(1, "fewest replicas; 0 lets an idle pool scale to zero")
    max_replicas: int = doc(1, "most replicas")
    target_queued_prompt_tokens: int = doc(8192, "prefill: queued prompt tokens per replica to aim for")
    target_running_requests: int = doc(32, "decode: running requests per replica to aim for")
    target_kv_usage: float = doc(0.8, "decode: KV-cache use (0-1) per replica to aim for")
    ttft_slo_ms: float | None = doc(None, "prefill: TTFT p90 above this asks for one more replica (default: off)")
    tpot_slo_ms: float | None = doc(None, "decode: TPOT p90 above this asks for one more replica (default: off)")
    upscale_window_s: float = doc(10.0, "a scale-up needs its load to last this long")
    downscale_window_s: float = doc(60.0, "a scale-down needs its quiet to last this long")
    max_step: int = doc(1, "most replicas added or removed by one decision")
    cold_start_timeout_s: float = doc(120.0, "from zero replicas: how long a waiting request may wait for one")

    def __post_init__(self) -> None:
        owner = "autoscaling"
        if self.min_replicas < 0:
            raise ConfigError(f"{owner}.min_replicas: must not be negative, got {self.min_replicas}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise ConfigError(f"{owner}: min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
                              if self.max_replicas < self.min_replicas else
                              f"{owner}.max_replicas: must be at least 1, got {self.max_replicas}")
        for key in ("target_queued_prompt_tokens", "target_running_requests", "max_step"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{owner}.{key}: must be at least 1, got {getattr(self, key)}")
        if not 0 < self.target_kv_usage <= 1:
            raise ConfigError(f"{owner}.target_kv_usage: must be in (0, 1], got {self.target_kv_usage}")
        for key in ("upscale_window_s", "downscale_window_s", "cold_start_timeout_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{owner}.{key}: must not be negative, got {getattr(self, key)}")


@dataclass(frozen=True)
class PoolSignals:
    """What the pool's replicas report, summed (or averaged) over the pool."""

    replicas: int  # running now
    queued_prompt_tokens: int = 0  # prefill: prompt tokens not yet computed
    running_requests: int = 0
    kv_usage: float = 0.0  # mean over replicas, 0-1
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    waiting_for_replica: int = 0  # requests held because the pool has no replica


@dataclass(frozen=True)
class Decision:
    desired: int
    raw: int  # before stabilisation, step limit and bounds
    reason: str
    signals: PoolSignals


@dataclass
class PoolPolicy:
    """One pool's policy; its only state is the recent raw recommendations."""

    role: Literal["prefill", "decode"]
    config: AutoscalingConfig
    _history: deque = field(default_factory=deque)  # (time, raw)
    _replicas: int | None = None  # the pool's size at the last decision

    def recommend(self, s: PoolSignals) -> tuple[int, str]:
        """The replica count the signals ask for, and which signal asked."""
        c = self.config
        asks: list[tuple[int, str]] = []
        if self.role == "prefill":
            asks.append((math.ceil(s.queued_prompt_tokens / c.target_queued_prompt_tokens), "queued_prompt_tokens"))
            if c.ttft_slo_ms is not None and s.ttft_p90_ms is not None and s.ttft_p90_ms > c.ttft_slo_ms:
                asks.append((s.replicas + 1, "ttft_p90_over_slo"))
        else:
            asks.append((math.ceil(s.running_requests / c.target_running_requests), "running_requests"))
            asks.append((math.ceil(s.replicas * s.kv_usage / c.target_kv_usage - 1e-9), "kv_usage"))
            if c.tpot_slo_ms is not None and s.tpot_p90_ms is not None and s.tpot_p90_ms > c.tpot_slo_ms:
                asks.append((s.replicas + 1, "tpot_p90_over_slo"))
        busy = s.queued_prompt_tokens or s.running_requests or s.waiting_for_replica
        if busy:
            asks.append((1, "busy"))
        return max(asks, key=lambda a: a[0]) if asks else (0, "idle")

    def decide(self, s: PoolSignals, now: float) -> Decision:
        c = self.config
        raw, reason = self.recommend(s)
        if s.replicas != self._replicas:  # moved by something else (a cold start, a restart): windows afresh
            self._history.clear()
        self._history.append((now, raw))
        horizon = now - max(c.upscale_window_s, c.downscale_window_s)
        while len(self._history) > 1 and self._history[1][0] <= horizon:  # keep one at or past the horizon:
            self._history.popleft()  # with ticks that do not land on it, the span still reaches the window
        current = s.replicas
        if current == 0 and s.waiting_for_replica:  # cold start: no window
            desired, reason = max(1, c.min_replicas), "cold_start"
        elif raw > current:
            seen = [r for t, r in self._history if t >= now - c.upscale_window_s]
            held = self._span(now) >= c.upscale_window_s
            desired = max(current, min(seen)) if held else current
            reason = reason if desired > current else f"hold ({reason} not sustained)"
        elif raw < current:
            seen = [r for t, r in self._history if t >= now - c.downscale_window_s]
            held = self._span(now) >= c.downscale_window_s
            desired = min(current, max(seen)) if held else current
            reason = "quiet" if desired < current else "hold (quiet not sustained)"
        else:
            desired, reason = current, "steady"
        step = max(-c.max_step, min(c.max_step, desired - current))
        desired = max(c.min_replicas, min(c.max_replicas, current + step))
        if desired != current:  # the next move needs a full window of what this one brings
            self._history.clear()
            self._history.append((now, raw))
        self._replicas = desired
        return Decision(desired, raw, reason, s)

    def _span(self, now: float) -> float:
        """How long the history covers (decisions must have been watching that long)."""
        return now - self._history[0][0] if self._history else 0.0
