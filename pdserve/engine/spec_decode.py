"""Speculative decoding inside the engine's step loop.

Each step, a decoding request may carry up to k proposed tokens. The scheduler reserves their
slots; the target model computes the request's last known token and the k proposals in one
forward pass (causal, through the paged cache, like a prompt chunk) and yields k + 1 rows of
logits; verification keeps the longest run of proposals the target agrees with, plus one token
of its own; the KV of the rejected proposals is rolled back (``num_computed_tokens`` moves back,
so their slots are overwritten later).

    step:  proposer.before_schedule(running)      ngram: the proposals, now (cheap)
           scheduler.schedule()                    reserves 1 + k slots per decoding request
           proposer.after_schedule(sched)          draft model: the proposals, in those slots
           runner.execute(sched)                   k + 1 rows of logits, verified
           scheduler.update(...)                   accepted tokens appended, rejected KV rolled back

Verification is exact. Greedy: the target's argmax at each row, accepted while it equals the
proposal. Seeded sampling: the target's own draw at each row (from the request's generator),
accepted while it equals the proposal; the generator then stands where one draw per emitted
token leaves it, so the output is token for token what the request gives without speculation.
Other sampling: modified rejection sampling (Leviathan et al., Chen et al. 2023): proposal
``d`` drawn from ``q`` is kept with probability ``min(1, p(d) / q(d))``; on rejection a token is
drawn from ``norm(max(0, p - q))``; after k acceptances a bonus token from ``p``. Proposals that
are deterministic (n-gram lookup, a greedy draft) are ``q`` one-hot, where this is "draw from
``p``, keep the proposal if the draw equals it". Either way the output distribution is the
target's.

Methods: ``ngram`` (prompt lookup: the continuation of the longest n-gram match of the
request's own last tokens, most recent match first) and ``draft`` (a smaller model with the
same vocabulary; its KV lives in its own cache tensor, addressed by the target's block table).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import torch

from pdserve.configs import ConfigError
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.request import Request

# ---- proposers ----------------------------------------------------------------------------


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram (``n_max`` down to ``n_min``) of ``tokens``; [] when none recurs."""
    size = len(tokens)
    if size <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n :]
        # Windows starting at 0 .. size - n - 1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def before_schedule(self, running: list[Request]) -> None:
        c = self.config
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                request.spec_token_ids = []
                continue
            request.spec_token_ids = ngram_propose(request.all_token_ids, c.num_speculative_tokens,
                                                   c.prompt_lookup_min, c.prompt_lookup_max)
            request.num_spec_slots = len(request.spec_token_ids)

    def after_schedule(self, sched) -> None:
        for item in sched.scheduled:
            if item.num_spec:
                item.spec_token_ids = item.request.spec_token_ids[: item.num_spec]


class DraftProposer:
    """A smaller model proposes autoregressively. Its KV cache has the target's block layout and
    is addressed by the target's block tables (the scheduler reserved the slots), so it needs no
    block management of its own; it catches up over a request's tokens from position 0 (prefix
    hits and remote KV hold only the target's KV)."""

    def __init__(self, config: SpeculativeConfig, target_runner, engine_config, vocab_size: int):
        from pdserve.engine.loader import load_model
        from pdserve.engine.model_runner import ModelRunner

        self.config = config
        loaded = load_model(config.model, dtype=target_runner.dtype, device=target_runner.device,
                            max_positions=engine_config.max_model_len,
                            seed=engine_config.seed + 1, progress=engine_config.load_progress)
        if loaded.config.vocab_size != vocab_size:
            raise ConfigError(f"speculative_config.model: the draft's vocabulary has {loaded.config.vocab_size} "
                              f"tokens, the target's {vocab_size}")
        model = loaded.model
        if config.draft_num_layers is not None and config.draft_num_layers < model.config.num_layers:
            model.layers = model.layers[: config.draft_num_layers]
            model.config = dataclasses.replace(model.config, num_layers=config.draft_num_layers)
        self.runner = ModelRunner(model, target_runner.kv_cache.shape[2], target_runner.block_size,
                                  engine_config.seed, engine_config.attention_backend)
        self._computed: dict[str, tuple[int, int]] = {}  # request id -> (draft KV positions, preemptions then)
        self.max_rows = engine_config.max_num_batched_tokens  # rows of one draft pass (the step's budget)
        self.generator = torch.Generator().manual_seed(engine_config.seed + 7)

    def before_schedule(self, running: list[Request]) -> None:
        live = set()
        for request in running:
            live.add(request.request_id)
            request.spec_token_ids = []
            decoding = request.num_tokens - request.num_computed_tokens == 1
            request.num_spec_slots = self.config.num_speculative_tokens if decoding else 0
        for request_id in [r for r in self._computed if r not in live]:
            del self._computed[request_id]

    @torch.inference_mode()
    def after_schedule(self, sched) -> None:
        from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

        items = [item for item in sched.scheduled if item.num_spec]
        if not items:
            return
        # Catch up: every position before the request's last known token, in passes of at most the
        # step's token budget (the shapes the warm-up built kernels for; a long prompt takes several).
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        pieces: dict[str, deque[ScheduledRequest]] = {}
        for item in items:
            request = item.request
            done, preemptions = self._computed.get(request.request_id, (0, request.num_preemptions))
            if preemptions != request.num_preemptions:
                done = 0
            target = request.num_tokens  # positions [done, target) computed, the last one sampled from
            pieces[request.request_id] = deque(
                ScheduledRequest(request, start, min(self.max_rows, target - start), item.block_ids, True)
                for start in range(done, target, self.max_rows))
            self._computed[request.request_id] = (target, request.num_preemptions)
            drafts[request.request_id], probs[request.request_id] = [], []
        last: dict[str, torch.Tensor] = {}  # each request's logits at its last known token
        while pieces:  # a pass: each request's next piece while they fit (a request's pieces in order)
            catch_up, rows = SchedulerOutput(), 0
            for request_id, queue in list(pieces.items()):
                if rows and rows + queue[0].num_tokens > self.max_rows:
                    continue
                catch_up.scheduled.append(queue.popleft())
                rows += catch_up.scheduled[-1].num_tokens
                if not queue:
                    del pieces[request_id]
            logits = self.runner.logits(catch_up)
            for row, s in enumerate(catch_up.scheduled):
                if s.start + s.num_tokens == s.request.num_tokens:
                    last[s.request.request_id] = logits[row]
        by_request = {id(item.request): item for item in items}
        current = [(item.request, last[item.request.request_id]) for item in items]
        for _ in range(max(item.num_spec for item in items)):
            nxt = SchedulerOutput()
            for request, row_logits in current:
                token, q = self._propose_one(row_logits, request)
                drafts[request.request_id].append(token)
                probs[request.request_id].append(q)
                item = by_request[id(request)]
                if len(drafts[request.request_id]) < item.num_spec:
                    position = request.num_tokens + len(drafts[request.request_id]) - 1
                    nxt.scheduled.append(ScheduledRequest(request, position, 1, item.block_ids, True,
                                                          spec_token_ids=drafts[request.request_id][:]))
            if not nxt.scheduled:
                break
            logits = self.runner.logits(nxt)
            current = [(s.request, logits[row]) for row, s in enumerate(nxt.scheduled)]
        for item in items:
            item.spec_token_ids = drafts[item.request.request_id][: item.num_spec]
            q = probs[item.request.request_id][: item.num_spec]
            item.draft_probs = None if any(x is None for x in q) else torch.stack(q)

    def _propose_one(self, logits: torch.Tensor, request: Request) -> tuple[int, torch.Tensor | None]:
        """Greedy and seeded requests get the draft's argmax (q one-hot, returned as None: the
        target's own draws decide, so a seeded request outputs what it would without a draft);
        other sampled ones a draw from the draft's own distribution under the request's
        temperature, top-k and top-p (more accepted, the same distribution)."""
        params = request.sampling_params
        if params.greedy or request.generator is not None:
            return int(logits.argmax()), None
        from pdserve.engine.sampler import _top_k_top_p

        scaled = _top_k_top_p((logits.float() / params.temperature)[None], [params.top_k], [params.top_p])[0]
        q = torch.softmax(scaled, dim=-1)
        if not torch.isfinite(q).all():
            return int(logits.argmax()), None
        return int(torch.multinomial(q, 1, generator=self.generator)), q


def make_proposer(config: SpeculativeConfig, runner, engine_config, vocab_size: int):
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftProposer(config, runner, engine_config, vocab_size)


# ---- verification -------------------------------------------------------------------------


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Modified rejection sampling for one request: ``target_probs`` ``[k + 1, V]`` (the target's
    processed distribution at each row), ``draft_tokens`` (k), ``draft_probs`` ``[k, V]`` (None:
    one-hot on the proposals). Returns the accepted proposals and one more token."""
    k = len(draft_tokens)
    out: list[int] = []
    for i in range(k):
        d = draft_tokens[i]
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0:  # p == q: any token of p would do
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
