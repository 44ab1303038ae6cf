"""The engine: requests in, a step function, request outputs (token and text deltas) out.

    step():  schedule() -> SchedulerOutput
             execute(SchedulerOutput) -> ModelOutput           (model runner)
             update(SchedulerOutput, ModelOutput) -> [CoreOutput]   (scheduler: tokens, token stops)
             text: incremental detokenisation, stop strings  -> [RequestOutput]

Callers (the offline ``LLM``, the workers) own the loop: add requests, call ``step()`` while
``has_unfinished()``, route each ``RequestOutput`` to whoever waits for it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_isa import select_isa
from pdserve.engine.cpu_kernels import HeapBound, keep_freed_memory
from pdserve.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager, kv_groups
from pdserve.engine.loader import LoadedModel, load_model
from pdserve.engine.model import Linear, warm_up_projections
from pdserve.engine.model_runner import ModelRunner, float_cache_dtype
from pdserve.engine.request import Request, RequestOutput, RequestStatus
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.scheduler import CoreOutput, Scheduler, SchedulerOutput
from pdserve.engine.spec_decode import SpeculativeConfig, make_proposer
from pdserve.engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    """A load snapshot (what routers and autoscalers read)."""

    num_running: int
    num_waiting: int
    num_waiting_remote_kv: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    num_preemptions: int
    prompt_tokens: int  # totals since start
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    waiting_prompt_tokens: int  # prompt tokens of waiting requests not yet computed
    spec_proposed: int = 0  # speculative decoding totals: tokens proposed, accepted, verification steps
    spec_accepted: int = 0
    spec_steps: int = 0
    prefill_tokens_per_s: float = 0.0  # prompt tokens per second of the recent steps computing prompts (0: none yet)
    decode_step_s: float = 0.0  # mean seconds of its recent decode-only steps (0: none yet)
    decode_step_seqs: float = 0.0  # their mean number of sequences


WARMUP_ENV = "PDSERVE_WARMUP"  # EngineConfig.warmup's default when unset: 0 off, else on

# Steps computing at least this many prompt tokens count in the measured prefill rate. A rate in tokens
# per second holds where compute dominates; a step of a short prompt measures the step's fixed cost
# (weights streamed once, sampling, the decodes beside it): counted, it made a worker that had seen
# only short prompts look several times slower than one not yet measured, and the router then took
# prompts off its prefill pool.
PREFILL_RATE_MIN_TOKENS = 256
PREFILL_RATE_STEPS = 16  # the rate is over this many such steps, however old (an idle worker keeps it)
# The measured decode step is over this many steps that computed no prompt token, however old. Steps
# with a prompt chunk are left out: the routers count a worker's prompt work apart (its queue), and a
# step time that held a chunk made a worker busy with prompts look many times slower to decode.
DECODE_STEP_SAMPLES = 16


def warmup_wanted(config: EngineConfig) -> bool:
    """``config.warmup``, or when unset the environment's PDSERVE_WARMUP (0: off; the test suite
    sets it, its engines being many and short-lived), else on."""
    if config.warmup is not None:
        return config.warmup
    return os.environ.get(WARMUP_ENV, "1") != "0"


def mean_decode_step(steps: deque[tuple[int, float]]) -> tuple[float, float]:
    """(mean seconds, mean sequences) of (sequences, seconds) samples; (0.0, 0.0) without any (the
    engine's and the simulator's replicas' measured decode step)."""
    if not steps:
        return 0.0, 0.0
    return sum(t for _, t in steps) / len(steps), sum(n for n, _ in steps) / len(steps)


@dataclass
class _TextState:
    """Per-request text: what was decoded, what was emitted, what is held back for stop strings.

    The text covers the whole output, also the tokens generated before the request reached this
    engine (a continuation), so a stop string that began there is still found here::

        text:  [ emitted (the client has it) | held back | new this step ]
                                             ^ emitted  ^ len(text) before the step
    """

    detokenizer: IncrementalDetokenizer
    stops: tuple[str, ...]
    hold: int  # characters kept back while a stop string could still be forming
    text: str = ""
    emitted: int = 0

    @classmethod
    def of(cls, request: Request, detokenizer: IncrementalDetokenizer) -> _TextState:
        p = request.sampling_params
        state = cls(detokenizer, p.stop, max((len(s) for s in p.stop), default=1) - 1)
        state.text = "".join(detokenizer.step(t) for t in request.output_token_ids)
        emitted = request.text_emitted
        state.emitted = len(state.text) if emitted is None else min(emitted, len(state.text))
        return state


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        self.cpu_plan = select_isa(config.cpu_isa) if config.device == "cpu" else None
        if self.cpu_plan is not None:
            self.cpu_plan.apply_env()  # binds if this is the process's first torch work (the CLI's workers)
            log.info("%s", self.cpu_plan.describe())
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # The heap keeps freed blocks for the next step's activations, up to a bound (HeapBound).
        self.heap = HeapBound.create() if keep_freed_memory() else None
        dtype = _DTYPES[config.dtype]
        self.loaded = loaded or load_model(
            config.model, dtype=dtype, device=config.device, max_positions=config.max_model_len, seed=config.seed,
            progress=config.load_progress, quantization=config.quantization,
            quantization_group_size=config.quantization_group_size, linear_path=self._linear_path(dtype),
        )
        self.model_config = cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.source.name
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.block_size = config.block_size
        # Layer groups with block tables of their own: a sliding-window model's local layers keep
        # only their window (the CUDA path, graphs and Triton kernels, takes one table).
        self.kv_groups = kv_groups(cfg, config.sliding_window_kv and config.device == "cpu")
        # A block holds one group's layers (all of them with one group).
        slots = self.kv_groups.num_slots
        cache_dtype = float_cache_dtype(config.kv_cache_dtype, dtype)
        if cache_dtype is not None:
            block_bytes = cfg.kv_bytes_per_token(cache_dtype.itemsize) * config.block_size * slots // cfg.num_layers
        else:  # one byte per element, plus a float32 scale per token and head
            from pdserve.engine.kv_quant import row_width

            block_bytes = 2 * slots * cfg.num_kv_heads * row_width(config.block_size, cfg.head_dim)
        self.kv_block_bytes = block_bytes
        num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gb * 2**30 // block_bytes)
        if num_blocks < 1:
            raise InvalidRequestError("kv_cache_memory_gb", f"{config.kv_cache_memory_gb} GiB holds no block")
        if self.kv_groups.num_groups > 1:
            if num_blocks < 2:
                raise InvalidRequestError("num_kv_blocks", "layer groups need 2 blocks or more (one is the null block)")
            self.kv = HybridKVCacheManager(num_blocks, config.block_size, self.kv_groups,
                                           config.enable_prefix_caching, self.loaded.fingerprint)
        else:
            self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                     self.loaded.fingerprint)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.scheduling_policy, config.max_prefill_tokens)
        self.runner = ModelRunner(
            self.loaded.model, num_blocks, config.block_size, config.seed, config.attention_backend,
            config.kv_cache_dtype, self.kv_groups, config.cpu_graph_max_batch,
        )
        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = (make_proposer(self.spec_config, self.runner, config, cfg.vocab_size)
                         if self.spec_config else None)
        if config.device == "cpu" and warmup_wanted(config):
            self._warm_up()
        self._text: dict[str, _TextState] = {}
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0}
        self._prefill_steps: deque[tuple[int, float]] = deque(maxlen=PREFILL_RATE_STEPS)  # (prompt tokens, seconds)
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=DECODE_STEP_SAMPLES)  # (sequences, seconds)
        # Called after each step that ran with (its SchedulerOutput, the step's seconds, schedule to
        # outputs); `pdserve profile` times steps through it. None: nothing is called.
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None

    def _warm_up(self) -> None:
        """oneDNN's kernels for every row bucket of a step, built now (``EngineConfig.warmup``): the
        model's, and a draft model's (speculative decoding) up to the same budget, its head up to one
        row per sequence (it proposes one token per sequence at a time)."""
        c, start = self.config, time.perf_counter()
        spec = self.spec_config.num_speculative_tokens if self.spec_config else 0
        models = [(self.loaded.model, min(c.max_num_batched_tokens, c.max_num_seqs * (1 + spec)))]
        draft = getattr(self.proposer, "runner", None)
        if draft is not None:
            models.append((draft.model, min(c.max_num_batched_tokens, c.max_num_seqs)))
        shapes = calls = 0
        # A step's rows: its prompt share, and a row per running sequence (its proposals' too) beside it.
        rows = min(c.max_num_batched_tokens, (c.max_prefill_tokens or c.max_num_batched_tokens)
                   + c.max_num_seqs * (1 + spec))
        for model, head_rows in models:
            s, n = warm_up_projections(model, rows, head_rows, c.load_progress)
            shapes, calls = shapes + s, calls + n
        if self.heap is not None:
            self.heap.check(time.monotonic())  # the warm-up's activations go back above the bound
        if calls:
            log.info("warm-up: %d projection shapes at %d row counts in %.1f s (oneDNN's kernels for every step "
                     "size up to %d tokens, larger ones at their first step; --no-warmup skips it)", shapes, calls,
                     time.perf_counter() - start, min(rows, Linear.WARM_MAX_ROWS))

    def _linear_path(self, dtype: torch.dtype) -> str:
        plan = self.cpu_plan
        if plan is None:
            return "mkl"
        if dtype != torch.float32 and plan.linear_path_for(dtype) == "mkl":
            log.warning("%s on %s: no fast matmuls for it here (emulated, slow); float32 is faster on this "
                        "processor", self.config.dtype, plan.isa)
        return plan.linear_path_for(dtype)

    # ---- requests ------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        output_token_ids: list[int] = (),
        emitted_text_len: int | None = None,
        handoff_after: int | None = None,
        start_within_s: float | None = None,
    ) -> Request:
        """Validate and build a request (not yet queued).

        ``output_token_ids``: tokens already generated for it elsewhere; only what follows them
        is reported (a continuation after a lost decode worker, or after remote prefill), and
        ``emitted_text_len`` characters of their text were already sent (None: all of it).
        ``handoff_after``: end here after this many new tokens, the request continuing
        elsewhere (finish reason ``handoff``; text that may begin a stop string is held back).
        ``start_within_s``: under the priority policy, a request still waiting unstarted this long
        after it was made ends with finish reason ``queue_timeout`` (ignored with prior outputs:
        their client has text already).
        """
        if request_id in self.scheduler.requests or request_id in self._text:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids, params)
        request = Request(
            request_id, ids, params, self.tokenizer.eos_token_ids, cache_salt, self.max_model_len, arrival_time
        )
        if output_token_ids:
            self._check_ids(list(output_token_ids), "output_token_ids")
            if len(ids) + len(output_token_ids) >= self.max_model_len:
                raise InvalidRequestError("output_token_ids", "prompt and earlier output fill the context",
                                          code="context_length_exceeded")
            if params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
                raise InvalidRequestError("output_token_ids", f"{len(output_token_ids)} earlier output tokens "
                                          f"already reach max_tokens ({params.max_tokens}): nothing is left")
            request.add_prior_outputs(list(output_token_ids), self.model_config.vocab_size, emitted_text_len)
        if handoff_after is not None:
            request.handoff_at = request.num_output_tokens + handoff_after
        if start_within_s and not output_token_ids:
            request.start_by = time.monotonic() + start_within_s
        return request

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {n} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must be left to generate", code="context_length_exceeded",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"this model's context is {self.max_model_len} tokens; the prompt has {n} and "
                f"max_tokens asks for {params.max_tokens} more", code="context_length_exceeded",
            )
        self._check_ids(ids, "prompt")
        if not self.kv.fits(n + 1, self.block_size):  # alone, a prompt is computed in chunks as small as that
            raise InvalidRequestError("prompt", f"{n} tokens do not fit in the KV cache ({self.kv.num_blocks} blocks)")

    def _check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(field, f"token id {bad} is outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        request = self.make_request(request_id, prompt, params or SamplingParams(), cache_salt, arrival_time)
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        """Queue a request built by ``make_request``."""
        self._track(request)
        self.scheduler.add_request(request)

    def reserve_remote_request(self, request: Request) -> list[int] | None:
        """Reserve blocks for a request whose prompt KV arrives from outside (None: no room)."""
        block_ids = self.scheduler.reserve_remote_kv(request)
        if block_ids is not None:
            self._track(request)
        return block_ids

    def finish_remote_kv(self, request_id: str, ok: bool, output_token_ids: list[int] = (),
                         emitted_text_len: int | None = None, start_within_s: float | None = None) -> None:
        """The KV of a reserved request landed (ok) or not (recompute here); it joins the queue.

        ``output_token_ids`` were sampled elsewhere (the prefill worker's first token), and
        ``emitted_text_len`` characters of their text were sent from there (None: all of it);
        generation continues after them. ``start_within_s``: as make_request's (a prompt computed
        here, nothing sent yet).
        """
        request = self.scheduler.requests[request_id]
        self._check_ids(list(output_token_ids), "output_token_ids")
        if start_within_s and not output_token_ids:
            request.start_by = time.monotonic() + start_within_s
        self.scheduler.finish_remote_kv(request_id, ok)
        request.add_prior_outputs(list(output_token_ids), self.model_config.vocab_size, emitted_text_len)
        self._text[request_id] = self._text_state(request)

    def _track(self, request: Request) -> None:
        self._text[request.request_id] = self._text_state(request)
        self._counters["prompt_tokens"] += request.num_prompt_tokens

    def _text_state(self, request: Request) -> _TextState:
        return _TextState.of(request, self.tokenizer.detokenizer(request.sampling_params.skip_special_tokens))

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self._ended(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))

    def _ended(self, requests: list[Request]) -> list[RequestOutput]:
        """The last output of requests ended from outside a step (with any text not yet sent)."""
        outputs = []
        for request in requests:
            state = self._text.pop(request.request_id, None)
            text = state.text[state.emitted :] if state else ""
            outputs.append(self._output(request, [], text, None, True))
        return outputs

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        timed_out = self._ended(self.scheduler.expire_unstarted(time.monotonic()))
        if self.proposer is not None:
            self.proposer.before_schedule(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.empty:
            return timed_out
        if self.proposer is not None:
            self.proposer.after_schedule(sched)
            for item in sched.scheduled:
                item.shrink_spec(len(item.spec_token_ids))
        prompt = sum(max(0, min(s.start + s.num_tokens, s.request.num_prompt_tokens) - s.start)
                     for s in sched.scheduled)
        start = time.perf_counter()
        model_out = self.runner.execute(sched)
        seconds = time.perf_counter() - start
        if prompt >= PREFILL_RATE_MIN_TOKENS:
            self._prefill_steps.append((prompt, seconds))
        elif not prompt:
            self._decode_steps.append((len(sched.scheduled), seconds))
        outputs = self._process(self.scheduler.update(sched, model_out))
        if self.step_observer is not None:
            self.step_observer(sched, time.perf_counter() - began)
        if self.heap is not None:
            self.heap.check(time.monotonic())
        return timed_out + outputs

    def prefill_rate(self) -> float:
        """Prompt tokens per second of the last steps that computed prompts (their decodes included:
        what a prompt sent here costs); 0.0 before the first. The routers' cost model reads it."""
        seconds = sum(t for _, t in self._prefill_steps)
        return sum(n for n, _ in self._prefill_steps) / seconds if seconds > 0 else 0.0

    def decode_step(self) -> tuple[float, float]:
        """Mean seconds and mean sequences of the last steps that computed no prompt token (0.0, 0.0
        before the first). The routers' cost model reads it as this worker's decode step."""
        return mean_decode_step(self._decode_steps)

    def _process(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        outputs = []
        for co in core_outputs:
            request, state = co.request, self._text[co.request.request_id]
            self._counters["generation_tokens"] += len(co.new_token_ids)
            check_from, ends = self._append_text(request, state, co)
            new_ids, logprobs, finished = co.new_token_ids, co.new_logprobs, co.finished
            # Stop strings are looked for also when the step ended the request (its length, a
            # stop token, a handoff), as vLLM does: a stop string found wins.
            if state.stops and request.num_output_tokens > request.sampling_params.min_tokens:
                stop_end = self._check_stop_strings(request, state, check_from)
                if stop_end is not None:
                    # A step of several tokens (speculative decoding) keeps those up to the one
                    # that completed the stop string, as one token per step would have.
                    kept = next((i + 1 for i, end in enumerate(ends) if end >= stop_end), len(new_ids))
                    new_ids, logprobs, finished = new_ids[:kept], logprobs and logprobs[:kept], True
                    request.drop_last_outputs(len(co.new_token_ids) - kept)
            handoff = request.status is RequestStatus.FINISHED_HANDOFF
            end = len(state.text) if finished and not handoff else max(state.emitted, len(state.text) - state.hold)
            new_text, state.emitted = state.text[state.emitted : end], end
            if finished:
                del self._text[request.request_id]
            outputs.append(self._output(request, new_ids, new_text, logprobs, finished))
        return outputs

    @staticmethod
    def _append_text(request: Request, state: _TextState, co: CoreOutput) -> tuple[int, list[int]]:
        """Detokenise the step's tokens. Returns where the stop-string search starts (text of
        tokens within ``min_tokens`` is not searched, as in vLLM) and the text's length after
        each token."""
        p = request.sampling_params
        ids = co.new_token_ids
        if co.finished and request.status is RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token (EOS or a stop_token_id) is not part of the text
        first = request.num_output_tokens - len(co.new_token_ids)  # output index of the step's first token
        check_from, ends = len(state.text), []
        for i, token_id in enumerate(ids):
            state.text += state.detokenizer.step(token_id)
            ends.append(len(state.text))
            if first + i + 1 <= p.min_tokens:
                check_from = len(state.text)
        return check_from, ends

    def _check_stop_strings(self, request: Request, state: _TextState, check_from: int) -> int | None:
        """End the request at the first stop string in the new text; where that string ends."""
        start = max(0, check_from - state.hold)
        found = [(i, s) for s in state.stops if (i := state.text.find(s, start)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        keep = index + len(stop) if request.sampling_params.include_stop_str_in_output else index
        state.text = state.text[:keep]
        state.emitted = min(state.emitted, keep)
        request.stop_reason = stop
        if request.status.finished:  # ended by this very step: the stop string is the reason
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        return index + len(stop)

    def _output(self, request: Request, new_ids, new_text, logprobs, finished: bool) -> RequestOutput:
        prompt_logprobs = None
        if request.prompt_logprobs is not None and new_ids and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(new_ids),
            new_text=new_text,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            new_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            spec_proposed=request.spec_proposed,
            spec_accepted=request.spec_accepted,
            spec_steps=request.spec_steps,
        )

    # ---- state ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        waiting_prompt = sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
        decode_s, decode_seqs = self.decode_step()
        c = self._counters
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_waiting_remote_kv=len(self.scheduler.remote),
            num_kv_blocks=self.kv.num_blocks,
            num_free_kv_blocks=self.kv.pool.num_free_blocks,
            kv_usage=self.kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"],
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            waiting_prompt_tokens=waiting_prompt,
            spec_proposed=self.scheduler.spec_totals[0],
            spec_accepted=self.scheduler.spec_totals[1],
            spec_steps=self.scheduler.spec_totals[2],
            prefill_tokens_per_s=self.prefill_rate(),
            decode_step_s=decode_s,
            decode_step_seqs=decode_seqs,
        )
