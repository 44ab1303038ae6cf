"""Iteration-level scheduler: continuous batching, chunked prefill, preemption by recompute.

There is no prefill phase and no decode phase. Each step, every running request asks for the
tokens it has not computed yet (one for a decoding request, a chunk for a prompt), within a
token budget; then waiting requests are admitted in order while budget, blocks and the cap on
running requests allow. When a running request cannot get a block, another running request is
preempted: its blocks are freed and it recomputes later (its prefix may still be in the cache).

Two policies (``scheduling_policy``, as vLLM's): ``fcfs`` admits in arrival order and preempts the
most recently admitted request; ``priority`` keeps the waiting queue ordered by (priority,
arrival), lower first, and preempts the running request of the lowest class (the highest
priority value; the latest arrival among equals), so a ``flex`` request gives way to a
``priority`` one under memory pressure. Under ``priority`` a request can be overtaken for as long
as requests of a higher class keep arriving; one given a ``start_by`` that is still waiting,
never started, when that time comes ends unstarted (``queue_timeout``) instead of waiting on.
Under ``fcfs`` the wait is bounded by the work ahead, and ``start_by`` is not applied.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    start: int  # first position computed this step (num_computed_tokens before the step)
    num_tokens: int  # positions [start, start + num_tokens) are computed this step
    block_ids: list[int]  # the request's block table, covering at least start + num_tokens
    sample: bool  # the step reaches the request's last known token: sample the next one
    # Speculative decoding: slots reserved for proposals after the last known token (num_tokens
    # counts them), and the proposals themselves (filled by the proposer; at most num_spec).
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec: int = 0
    draft_probs: object = None  # [num_spec, vocab] draft distribution (None: proposals are one-hot)
    # With layer groups (a sliding-window model's cache, see kv_cache_manager): every group's
    # table, block_ids being the first's; None with one group.
    group_block_ids: list[list[int]] | None = None

    def shrink_spec(self, num_spec: int) -> None:
        """Give back reserved proposal slots the proposer did not fill."""
        drop = self.num_spec - num_spec
        if drop > 0:
            self.num_spec -= drop
            self.num_tokens -= drop
            self.request.num_computed_tokens -= drop


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelOutput:
    """What ``execute`` produced: new tokens (and logprobs) of the requests that sampled."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Prompt logprobs computed this step: (first prompt position, its logprobs and the following ones).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class CoreOutput:
    """Token-level result of a step for one request (text comes later, in the engine)."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finished: bool


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: str = "fcfs",
        max_prefill_tokens: int | None = None,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: {policy!r} is not fcfs or priority")
        self.kv = kv
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prompt tokens (chunks of prompts, recomputations) one step computes at most; decoding requests'
        # tokens come on top, within max_num_batched_tokens. None: the whole budget.
        self.max_prefill_tokens = max_prefill_tokens or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, blocks reserved
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache at first admission
        self.prefix_hits = 0  # of those, tokens found
        self.spec_totals = [0, 0, 0]  # speculative tokens proposed, accepted; verification steps
        self.num_queue_timeouts = 0  # requests ended unstarted at their start_by
        self._next_start_by: float | None = None  # the earliest start_by in the queue (or earlier)

    # ---- admission -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request)
        self._note_start_by(request)

    def _note_start_by(self, request: Request) -> None:
        if self.policy != "priority":
            request.start_by = None  # fcfs: the work ahead bounds the wait
        elif request.start_by is not None:
            nxt = self._next_start_by
            self._next_start_by = request.start_by if nxt is None else min(nxt, request.start_by)

    def expire_unstarted(self, now: float) -> list[Request]:
        """End waiting requests that never started and whose ``start_by`` has passed (status
        FINISHED_QUEUE_TIMEOUT): they hold no blocks and have produced nothing."""
        if self._next_start_by is None or now < self._next_start_by:
            return []
        expired = [r for r in self.waiting if r.start_by is not None and r.start_by <= now]
        for request in expired:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_QUEUE_TIMEOUT
            self._remove(request)
        self.num_queue_timeouts += len(expired)
        self._next_start_by = min((r.start_by for r in self.waiting if r.start_by is not None), default=None)
        return expired

    @staticmethod
    def _order(request: Request) -> tuple[int, float]:
        return request.sampling_params.priority, request.arrival_time

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back (fcfs; ``front``: a preempted request, at the head),
        or at its place by (priority, arrival) (priority: a preempted request keeps its arrival,
        so it goes ahead of later ones of its class)."""
        if self.policy == "priority":
            bisect.insort_right(self.waiting, request, key=self._order)  # no list of every waiting key
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def reserve_remote_kv(self, request: Request) -> list[int] | None:
        """Reserve blocks for a prompt whose KV will be written from outside; None if no room.

        A local prefix hit is kept: the request's ``num_computed_tokens`` says how many
        leading tokens are already here, so only the rest needs to arrive.
        """
        hits = self.kv.get_computed_blocks(request)
        cached = len(hits) * self.kv.block_size
        if self.kv.allocate_slots(request, request.num_tokens - cached, hits, delay_caching=True) is None:
            return None
        request.num_computed_tokens = cached
        request.num_cached_tokens = request.num_computed_tokens
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_cached_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return self.kv.block_ids(request.request_id)

    def finish_remote_kv(self, request_id: str, ok: bool) -> None:
        """The remote KV has landed (ok) or failed (recompute locally); queue the request."""
        request = self.remote.pop(request_id)
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self._enqueue(request)
        self._note_start_by(request)

    # ---- the step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill = self.max_prefill_tokens  # of the budget, what prompt chunks may still take
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            chunk = num_new > 1  # a prompt chunk (or a recomputation): within the prompt share too
            if chunk and (num_new := self._within_share(num_new, prefill)) == 0:
                i += 1
                continue
            num_spec = self._spec_slots(request, budget)
            preempted, before, returned = self._allocate_or_preempt(request, num_new + num_spec, out)
            i -= before  # preempted requests ahead of it in the list: it moved up
            budget += returned  # the step's tokens of preempted requests already scheduled come back
            if returned:
                prefill = self.max_prefill_tokens - self._prompt_tokens(out)
            if preempted:
                continue  # it gave its own blocks back (fcfs: it was the last; priority: the lowest class)
            out.scheduled.append(self._take(request, num_new, num_spec))
            budget -= num_new + num_spec
            if chunk:
                prefill -= num_new
            i += 1
        if not out.preempted_ids:
            budget = self._admit_waiting(budget, out, prefill)
        return out

    @staticmethod
    def _within_share(num_new: int, prefill: int) -> int:
        """A prompt chunk of ``num_new`` tokens cut to the step's prompt share left (0: it is spent)."""
        return min(num_new, max(prefill, 0))

    @staticmethod
    def _prompt_tokens(out: SchedulerOutput) -> int:
        """Tokens of prompt chunks (not decodes, nor their proposal slots) scheduled in ``out`` so far."""
        return sum(s.num_tokens for s in out.scheduled if s.num_tokens - s.num_spec > 1)

    @staticmethod
    def _spec_slots(request: Request, budget: int) -> int:
        """Proposal slots for a decoding request, within the budget and its output limit."""
        if request.num_tokens - request.num_computed_tokens != 1 or not request.num_spec_slots:
            return 0
        k = min(request.num_spec_slots, budget - 1)
        for limit in (request.max_output_tokens, request.handoff_at):
            if limit is not None:
                k = min(k, limit - request.num_output_tokens - 1)
        return max(k, 0)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             out: SchedulerOutput) -> tuple[bool, int, int]:
        """Room for ``request``'s tokens, preempting others until there is. (whether ``request``
        itself was preempted, how many preempted requests stood before it in ``running``, the
        tokens of this step taken back from preempted requests already scheduled)."""
        before = returned = 0
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._victim()
            if victim is not request and self.running.index(victim) < self.running.index(request):
                before += 1
            self.running.remove(victim)
            for j, item in enumerate(out.scheduled):  # already given a share of this step: taken back
                if item.request is victim:
                    returned += item.num_tokens
                    del out.scheduled[j]
                    break
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return True, before, returned
        return False, before, returned

    def _victim(self) -> Request:
        """The running request to preempt: the most recently admitted (fcfs), or the lowest class's
        latest arrival (priority)."""
        if self.policy == "priority":
            return max(self.running, key=self._order)
        return self.running[-1]

    def admit(self, budget: int) -> SchedulerOutput:
        """The waiting requests admitted within ``budget`` tokens, as ``schedule`` admits them after its
        running requests: for a caller that stepped the running requests itself (the simulator's
        decode-only part of a step, pdserve/bench/sim.py), with no preemption among them."""
        out = SchedulerOutput()
        self._admit_waiting(budget, out, self.max_prefill_tokens)
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput, prefill: int) -> int:
        """Admit waiting requests in order within ``budget`` tokens, of which prompt chunks take at most
        ``prefill``; the budget left."""
        bs = self.kv.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            fresh = not self.kv.holds_blocks(request.request_id)
            # Prompt logprobs need every prompt position computed: no prefix hits (as vLLM).
            hits = self.kv.get_computed_blocks(request) if fresh and request.prompt_logprobs is None else []
            num_computed = request.num_computed_tokens + len(hits) * bs
            num_new = min(request.num_tokens - num_computed, budget)
            chunk = num_new > 1
            if chunk and (num_new := self._within_share(num_new, prefill)) == 0:
                break  # the step's prompt share is spent: it waits for the next step, in its place
            got = self.kv.allocate_slots(request, num_new, hits)
            while got is None and self.kv.shrink_chunks and not self.running and num_new > bs:
                # Alone and still short, where a window bounds what a sequence holds (layer groups):
                # a smaller chunk needs fewer blocks in all (the window and the chunk), so a
                # recomputed sequence longer than one chunk's room still runs.
                num_new = max(bs, num_new // 2)
                got = self.kv.allocate_slots(request, num_new, hits)
            if got is None:
                if self.running or not self._release_waiting_blocks(request):
                    break  # running requests will free blocks (or preempt each other)
                continue  # the head again, with the blocks a request behind it gave back
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING and fresh:
                request.num_cached_tokens = num_computed
                self.prefix_queries += request.num_tokens
                self.prefix_hits += num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.start_by = None  # started: it runs to its end (or is preempted and recomputes)
            self.running.append(request)
            out.scheduled.append(self._take(request, num_new))
            budget -= num_new
            if chunk:
                prefill -= num_new
        return budget

    def _release_waiting_blocks(self, head: Request) -> bool:
        """Nothing runs and the queue's head cannot get a block: free the blocks of the last waiting
        request behind it that holds some (remote KV that landed, each request needing one more block
        for its next token, can hold every block: without this nothing would ever run again). That
        request recomputes when admitted; its prompt's blocks stay in the prefix cache until evicted.
        False when no request behind the head holds a block."""
        for request in reversed(self.waiting):
            if request is not head and self.kv.holds_blocks(request.request_id):
                self._preempt(request, requeue=False)
                return True
        return False

    def _take(self, request: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        sample = request.num_computed_tokens == request.num_tokens
        request.num_computed_tokens += num_spec
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=num_new + num_spec,
            block_ids=self.kv.block_ids(request.request_id),
            group_block_ids=self.kv.group_block_ids(request.request_id),
            sample=sample,
            spec_token_ids=request.spec_token_ids[:num_spec],
            num_spec=num_spec,
        )

    def _preempt(self, request: Request, requeue: bool = True) -> None:
        """Free the request's blocks; it recomputes from the start. ``requeue``: put it at the head
        of the queue (a running request; a waiting one keeps its place)."""
        self.kv.free(request)
        request.spec_token_ids, request.num_spec_slots = [], 0
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if requeue:
            self._enqueue(request, front=True)

    def update(self, sched: SchedulerOutput, model_out: ModelOutput) -> list[CoreOutput]:
        """Append sampled tokens, apply token-level stops, free what finished."""
        outputs = []
        for item in sched.scheduled:
            request = item.request
            if request.request_id in model_out.prompt_logprobs:
                first, values = model_out.prompt_logprobs[request.request_id]
                request.prompt_logprobs[first : first + len(values)] = values
            if not item.sample or request.status.finished:
                continue
            sampled = model_out.sampled_token_ids[request.request_id]
            if item.num_spec:  # roll back the KV of the rejected proposals
                accepted = len(sampled) - 1
                request.num_computed_tokens -= item.num_spec - accepted
                request.spec_proposed += item.num_spec
                request.spec_accepted += accepted
                request.spec_steps += 1
                self.spec_totals[0] += item.num_spec
                self.spec_totals[1] += accepted
                self.spec_totals[2] += 1
            request.spec_token_ids, request.num_spec_slots = [], 0
            new_tokens = []
            for token_id in sampled:
                request.append_output_token(token_id)
                new_tokens.append(token_id)
                if self._check_stop(request):
                    break
            logprobs = model_out.logprobs.get(request.request_id)
            if logprobs is not None:
                logprobs = logprobs[: len(new_tokens)]
            if request.status.finished:
                self._remove(request)
            outputs.append(CoreOutput(request, new_tokens, logprobs, request.status.finished))
        return outputs

    @staticmethod
    def _check_stop(request: Request) -> bool:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.max_output_tokens is not None and request.num_output_tokens >= request.max_output_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        if request.handoff_at is not None and request.num_output_tokens >= request.handoff_at:
            request.status = RequestStatus.FINISHED_HANDOFF
            return True
        return False

    # ---- ending requests ---------------------------------------------------------------

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, a stop string found in the text)."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.remote[request_id]
            else:
                self.waiting.remove(request)
            request.status = status
            self._remove(request)
            ended.append(request)
        return ended

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
