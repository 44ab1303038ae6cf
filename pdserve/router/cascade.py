"""Cascades: a virtual model that answers with a cheap model when it is confident, else a dearer one.

A cascade (``cascades:`` in the cluster YAML) names its stages, served models from the cheapest
up. A request to the cascade runs on the first stage with the sampled tokens' log-probabilities
(the worker computes them anyway); the scorer accepts the answer when every choice's mean token
log-probability is at least ``accept_mean_logprob`` and its lowest at least
``accept_min_logprob`` (each when set); otherwise the request runs again on the next stage. The
last stage's answer is always taken. FrugalGPT and RouteLLM route this way on a learned score;
pdserve's score is the model's own confidence, which ``pdserve cascade calibrate`` turns into a
threshold for a prompt set (the share the cheap stage answers against agreement with the dear one).

The response's ``model`` is the stage that answered; ``usage`` counts every stage's tokens and
lists them (``usage.stages``: each stage's model, tokens, scores and whether it was accepted).
Streaming holds a stage's answer until it is accepted, then sends it; the last stage streams as it
generates. Everything here is pure; the router (app.py) runs the stages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.configs import ConfigError, doc


@dataclass(frozen=True)
class CascadeConfig:
    stages: list[str] = doc(default_factory=list, help="served model names (or aliases), the cheapest first; at "
                                                       "least two")
    accept_mean_logprob: float | None = doc(None, "accept a stage's answer when the mean log-probability of "
                                                  "its tokens is at least this (every choice's)")
    accept_min_logprob: float | None = doc(None, "and when its least likely token's log-probability is at "
                                                 "least this (every choice's)")

    def __post_init__(self) -> None:
        if len(self.stages) < 2:
            raise ConfigError(f"stages: a cascade needs at least two models, got {self.stages}")
        if len(set(self.stages)) < len(self.stages):
            raise ConfigError(f"stages: a model is named twice: {self.stages}")
        if self.accept_mean_logprob is None and self.accept_min_logprob is None:
            raise ConfigError("accept_mean_logprob, accept_min_logprob: set at least one (pdserve cascade "
                              "calibrate suggests a value)")
        for key in ("accept_mean_logprob", "accept_min_logprob"):
            value = getattr(self, key)
            if value is not None and value > 0:
                raise ConfigError(f"{key}: a log-probability is at most 0, got {value}")


@dataclass(frozen=True)
class Score:
    """One answer's confidence: over its tokens' log-probabilities, the mean and the least."""

    mean: float
    min: float
    tokens: int

    @staticmethod
    def of(logprobs: Iterable[float]) -> Score:
        values = list(logprobs)
        if not values:  # nothing to judge an empty answer by: not confident
            return Score(-math.inf, -math.inf, 0)
        return Score(sum(values) / len(values), min(values), len(values))


def accepts(config: CascadeConfig, scores: list[Score]) -> bool:
    """Whether a stage's answer stands: every choice clears every threshold that is set."""
    return all((config.accept_mean_logprob is None or s.mean >= config.accept_mean_logprob)
               and (config.accept_min_logprob is None or s.min >= config.accept_min_logprob) for s in scores)


def rounded(value: float) -> float | None:
    """A score as JSON carries it (None for an empty answer's -inf)."""
    return None if math.isinf(value) else round(value, 4)
