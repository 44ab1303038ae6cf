"""Offline use: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``LLM.chat(...)``.

    from pdserve.engine import LLM, SamplingParams
    llm = LLM()                                    # the default model
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from pdserve.configs import from_dict
from pdserve.engine.config import DEFAULT_MODEL, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestOutput, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class GenerationResult:
    """One prompt's completions (``n`` of them), as vLLM's ``RequestOutput``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        config = from_dict(EngineConfig, {"model": model, **engine_options})
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        results = [self._submit(p, sp) for p, sp in zip(prompts, params)]
        self._run(results, use_tqdm)
        return results

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one request, yielding its deltas as steps produce them."""
        params = sampling_params or SamplingParams()
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params.replace(n=1))
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _submit(self, prompt: Prompt, params: SamplingParams) -> GenerationResult:
        base = str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        result = GenerationResult(base, text, [], [CompletionOutput(i) for i in range(params.n)])
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = params.replace(n=1, seed=seed)
            request = self.engine.add_request(f"{base}-{i}", prompt, child)
            result.prompt_token_ids = request.prompt_token_ids
        return result

    def _run(self, results: list[GenerationResult], use_tqdm: bool) -> None:
        by_id = {f"{r.request_id}-{o.index}": (r, o) for r in results for o in r.outputs}
        bar = tqdm(total=len(by_id), desc="generating", unit="req", disable=not use_tqdm, leave=False)
        with bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    result, comp = by_id[out.request_id]
                    comp.text += out.new_text
                    comp.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs is not None:
                        comp.logprobs = (comp.logprobs or []) + out.new_logprobs
                    result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                    if out.finished:
                        comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                        bar.update(1)
