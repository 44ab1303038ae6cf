"""Log-probabilities as the engine reports them: plain dataclasses, without torch, so that the
router (which never runs a model) shares them with the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token, and its rank among all tokens (1 = most likely)."""

    token_id: int
    logprob: float
    rank: int


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the top alternatives at one position."""

    sampled: Logprob
    top: list[Logprob]
