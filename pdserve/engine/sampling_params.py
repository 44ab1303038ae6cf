"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending parameter."""

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.code = code


_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs too (and this many top ones at each)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # scheduling class under scheduling_policy=priority: lower is served first (vLLM's)
    extra: dict = field(default_factory=dict, compare=False)  # opaque to the engine

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, message: str) -> None:
            raise InvalidRequestError(name, message)

        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (all tokens) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
