"""Per-tenant budgets, reserved at admission: requests per minute, tokens per minute, sequences at once.

Each per-minute limit is a bucket that holds at most the limit and refills continuously (the limit
per 60 s), as OpenAI describes its own. A request takes one from its tenant's request bucket when it
arrives; once tokenised it reserves its prompt tokens plus ``max_tokens`` x ``n`` from the token
bucket (``max_tokens`` unset: what the context leaves) and its sequences (prompts x ``n``) from the
tenant's concurrency; when it ends, the tokens it did not use go back and its sequences are freed.
A request that does not fit is answered 429 with ``Retry-After`` and OpenAI's headers
(``x-ratelimit-limit-requests`` / ``-remaining-`` / ``-reset-``, the same for tokens), and takes
nothing; an answer that passed carries the same headers (``headers``). A limit of 0 is no limit; a
tenant without limits, and the open API (no keys), skip all of it.

The buckets live in the router process: several routers each enforce the whole limit (divide it by
the number of routers to bound the total).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class RateLimited(Exception):
    """A request over its tenant's budget: what to say, and the headers to say it with."""

    def __init__(self, message: str, headers: dict[str, str]):
        super().__init__(message)
        self.headers = headers


@dataclass
class Bucket:
    """``limit`` per minute, refilled continuously; ``level`` is what may be taken now."""

    limit: int
    level: float = field(init=False)
    updated: float = 0.0

    def __post_init__(self) -> None:
        self.level = float(self.limit)

    def refill(self, now: float) -> None:
        self.level = min(float(self.limit), self.level + (now - self.updated) * self.limit / 60.0)
        self.updated = now

    def wait_s(self, n: float) -> float:
        """Seconds until ``n`` can be taken (after ``refill``); inf when ``n`` is over the limit."""
        if n > self.limit:
            return math.inf
        return max(0.0, (n - self.level) * 60.0 / self.limit)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return (self.limit - self.level) * 60.0 / self.limit


def _duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent_sequences: int = 0


@dataclass
class Reservation:
    """What an admitted request holds until it ends (``Budgets.release``)."""

    tenant: str
    tokens: int
    sequences: int


class _TenantBudget:
    def __init__(self, limits: Limits, now: float):
        self.limits = limits
        self.requests = Bucket(limits.requests_per_minute, updated=now) if limits.requests_per_minute else None
        self.tokens = Bucket(limits.tokens_per_minute, updated=now) if limits.tokens_per_minute else None
        self.sequences = 0

    def headers(self) -> dict[str, str]:
        out = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
                out[f"x-ratelimit-reset-{kind}"] = _duration(bucket.reset_s())
        return out


class Budgets:
    """Every tenant's budget (``limits``: tenant name -> Limits; tenants not there are unlimited)."""

    def __init__(self, limits: Mapping[str, Limits], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        now = clock()
        self._tenants = {name: _TenantBudget(lim, now) for name, lim in limits.items()
                         if lim.requests_per_minute or lim.tokens_per_minute or lim.max_concurrent_sequences}

    def admit(self, tenant: str) -> None:
        """A request arrives: take one from its tenant's request bucket, or raise RateLimited."""
        budget = self._tenants.get(tenant)
        if budget is None or budget.requests is None:
            return
        budget.requests.refill(self.clock())
        if budget.requests.level < 1:
            wait = budget.requests.wait_s(1)
            raise self._limited(budget, wait, f"Rate limit reached for tenant {tenant!r} on requests per min "
                                              f"(RPM): Limit {budget.limits.requests_per_minute}. Please try "
                                              f"again in {_duration(wait)}.")
        budget.requests.level -= 1

    def reserve(self, tenant: str, tokens: int, sequences: int) -> Reservation | None:
        """Reserve a tokenised request's tokens and sequences, or raise RateLimited taking nothing.
        None for a tenant without token or sequence limits (nothing to give back)."""
        budget = self._tenants.get(tenant)
        if budget is None or (budget.tokens is None and not budget.limits.max_concurrent_sequences):
            return None
        cap = budget.limits.max_concurrent_sequences
        if cap and budget.sequences + sequences > cap:
            if sequences > cap:
                raise self._limited(budget, math.inf, f"Request too large for tenant {tenant!r}: {sequences} "
                                                      f"sequences (prompts x n); its limit at once is {cap}")
            raise self._limited(budget, 1.0, f"Rate limit reached for tenant {tenant!r} on sequences at once: "
                                             f"Limit {cap}, in flight {budget.sequences}, requested {sequences}.")
        if budget.tokens is not None:
            budget.tokens.refill(self.clock())
            if budget.tokens.level < tokens:
                wait = budget.tokens.wait_s(tokens)
                limit = budget.limits.tokens_per_minute
                if math.isinf(wait):
                    raise self._limited(budget, wait, f"Request too large for tenant {tenant!r} on tokens per min "
                                                      f"(TPM): Limit {limit}, Requested {tokens} (prompt tokens + "
                                                      f"max_tokens x n). Lower max_tokens or the prompt.")
                used = limit - math.floor(budget.tokens.level)
                raise self._limited(budget, wait, f"Rate limit reached for tenant {tenant!r} on tokens per min "
                                                  f"(TPM): Limit {limit}, Used {used}, Requested {tokens}. Please "
                                                  f"try again in {_duration(wait)}.")
            budget.tokens.level -= tokens
        budget.sequences += sequences
        return Reservation(tenant, tokens, sequences)

    def release(self, reservation: Reservation | None, used_tokens: int) -> None:
        """The request ended having used ``used_tokens``: the rest of its reservation goes back."""
        if reservation is None:
            return
        budget = self._tenants[reservation.tenant]
        budget.sequences -= reservation.sequences
        if budget.tokens is not None:
            budget.tokens.refill(self.clock())
            budget.tokens.level = min(float(budget.tokens.limit),
                                      budget.tokens.level + max(0, reservation.tokens - used_tokens))

    def headers(self, tenant: str) -> dict[str, str]:
        """The tenant's x-ratelimit-* headers as of now (empty without limits)."""
        budget = self._tenants.get(tenant)
        if budget is None:
            return {}
        now = self.clock()
        for bucket in (budget.requests, budget.tokens):
            if bucket is not None:
                bucket.refill(now)
        return budget.headers()

    @staticmethod
    def _limited(budget: _TenantBudget, wait_s: float, message: str) -> RateLimited:
        headers = budget.headers()
        if not math.isinf(wait_s):
            headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
        return RateLimited(message, headers)
