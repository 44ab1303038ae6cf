"""A request inside the engine, and what the engine reports about it after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.block_pool import BlockHash
from pdserve.engine.logprobs import Logprob, TokenLogprobs  # noqa: F401 (also imported from here)
from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, KV arriving from a prefill worker
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # This engine's part is done and the request continues elsewhere (a prefill worker hands its
    # request to a decode worker after the first token): finished here, not for the client.
    FINISHED_HANDOFF = "handoff"
    # Never started: it waited past its start_by (see Request.start_by); nothing was computed or sent.
    FINISHED_QUEUE_TIMEOUT = "queue_timeout"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_HANDOFF, RequestStatus.FINISHED_QUEUE_TIMEOUT)


class Request:
    """One sequence. Its KV catches up with its tokens: ``num_computed_tokens <= num_tokens``.

        all_token_ids:  [ prompt ............ | output ...... ]
                        [ computed (KV in cache) ...... | to compute ]
                                                 ^ num_computed_tokens
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first scheduling
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.block_hashes: list[BlockHash] = []
        # Prompt logprobs (when asked for): position i holds prompt token i's, given the tokens
        # before it (position 0 has none). Filled as the prompt's chunks are computed; reported
        # with the first output.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * self.num_prompt_tokens if sampling_params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        # Speculative decoding: this step's proposals, the slots the scheduler is to reserve for
        # them, and totals (proposed, accepted, verification steps).
        self.spec_token_ids: list[int] = []
        self.num_spec_slots = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.spec_steps = 0
        room = (max_model_len - self.num_prompt_tokens) if max_model_len else None
        limits = [x for x in (sampling_params.max_tokens, room) if x is not None]
        self.max_output_tokens: int | None = min(limits) if limits else None
        # Output count at which this engine hands the request on (None: it runs to the end here).
        self.handoff_at: int | None = None
        # Characters of the prior outputs' text the client already has (see add_prior_outputs).
        self.text_emitted: int | None = None
        # time.monotonic() by which the request must start, or end unstarted (queue_timeout); None:
        # no bound. Cleared when it is first scheduled. Only the priority policy applies it (see
        # Scheduler.expire_unstarted).
        self.start_by: float | None = None
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_last_outputs(self, n: int) -> None:
        """Forget the last ``n`` output tokens of a finished request (generated in the step that
        completed a stop string, after it)."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]

    def add_prior_outputs(self, token_ids: list[int], vocab_size: int, text_emitted: int | None = None) -> None:
        """Tokens generated for this request elsewhere (a prefill worker's first token, or what
        a lost decode worker streamed). They count as output; a seeded generator moves past
        the draws that produced them, so what follows is what one worker would have sampled.

        ``text_emitted``: characters of their text already sent to the client (None: all of it).
        The earlier worker held back the rest while a stop string could still be forming; this
        engine sends it, or cuts it at a stop string, as one engine would have."""
        self.text_emitted = text_emitted
        for token_id in token_ids:
            self.append_output_token(token_id)
        if self.generator is not None and token_ids:
            torch.empty(len(token_ids), vocab_size).exponential_(generator=self.generator)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass
class RequestOutput:
    """What a step changed for one request (deltas, so streaming is cheap)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "handoff" | "queue_timeout"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first output, when asked for
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Speculative decoding totals so far: tokens proposed, of those accepted, verification steps.
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
