"""Building OpenAI response bodies and stream chunks from the workers' messages."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.tokenizer import ModelTokenizer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.worker_client import logprobs_of, stop_reason_of

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


@dataclass
class Choice:
    """One completion choice as it accumulates."""

    index: int
    prefix: str = ""  # echoed prompt (completions with echo)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    text_len: int = 0  # characters of generated text so far (logprobs' text offsets)
    prompt_ids: list[int] = field(default_factory=list)  # echo with logprobs: the prompt's tokens
    prompt_logprobs: list[TokenLogprobs] | None = None  # theirs from position 1 on (the first message brings them)
    prompt_logprobs_sent: bool = False  # streaming: already in a chunk

    def add(self, msg: pb.GenerateResponse, now: float) -> tuple[str, list[TokenLogprobs]]:
        """Record a message; return its text and logprobs."""
        lps = logprobs_of(msg.logprobs) if msg.logprobs else []
        if msg.prompt_logprobs:
            self.prompt_logprobs = logprobs_of(msg.prompt_logprobs)
        self.text_len += len(msg.text)
        self.text.append(msg.text)
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(lps)
        if msg.token_ids:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        if msg.finished:
            self.finish_reason = _FINISH.get(msg.finish_reason, msg.finish_reason)
            self.stop_reason = stop_reason_of(msg)
        return msg.text, lps

    @property
    def full_text(self) -> str:
        return self.prefix + "".join(self.text)


def sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def cached_prompt_tokens(per_choice: list[int | None], n: int) -> int:
    """``usage.prompt_tokens_details.cached_tokens``: like ``prompt_tokens``, each prompt counts once
    (choices ``p * n ... p * n + n - 1`` are its samples), with the largest hit any of its samples had."""
    hits = [h or 0 for h in per_choice]
    return sum(max(hits[p:p + n]) for p in range(0, len(hits), n))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Formatter:
    """Turns choices into one endpoint's response shapes."""

    def __init__(self, tokenizer: ModelTokenizer, request_id: str, model: str, chat: bool,
                 service_tier: str | None = None):
        self.tokenizer = tokenizer
        self.service_tier = service_tier  # the class the request was served in, echoed as OpenAI does
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._heads: dict[int, bytes] = {}

    def _base(self, obj: str) -> dict:
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.service_tier is not None:
            base["service_tier"] = self.service_tier
        return base

    # ---- logprobs ---------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        content = []
        for lp in lps:
            text, raw = self._token(lp.sampled.token_id)
            top = []
            for t in lp.top:
                t_text, t_raw = self._token(t.token_id)
                top.append({"token": t_text, "logprob": t.logprob, "bytes": t_raw})
            content.append({"token": text, "logprob": lp.sampled.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int, echo: Choice | None = None) -> dict:
        """Completions' logprobs; with ``echo`` (a choice with prompt logprobs) the prompt's tokens
        come first, the first of them without a logprob (nothing precedes it), as vLLM does."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        if echo is not None and echo.prompt_logprobs is not None:
            at = 0
            for token_id, lp in zip(echo.prompt_ids, [None, *echo.prompt_logprobs]):
                text, _ = self._token(token_id)
                tokens.append(text)
                token_logprobs.append(lp.sampled.logprob if lp else None)
                top.append({self._token(t.token_id)[0]: t.logprob for t in lp.top} if lp else None)
                offsets.append(at)
                at += len(text)
        for lp in lps:
            text, _ = self._token(lp.sampled.token_id)
            tokens.append(text)
            token_logprobs.append(lp.sampled.logprob)
            top.append({self._token(t.token_id)[0]: t.logprob for t in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # ---- whole responses --------------------------------------------------------------------

    def response(self, choices: list[Choice], want_logprobs: bool, use: dict) -> dict:
        out = self._base("chat.completion" if self.chat else "text_completion")
        out["choices"] = [self._choice(c, want_logprobs) for c in choices]
        out["usage"] = use
        return out

    def _choice(self, c: Choice, want_logprobs: bool) -> dict:
        body = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.chat:
            body["message"] = {"role": "assistant", "content": c.full_text}
            body["logprobs"] = self.chat_logprobs(c.logprobs) if want_logprobs else None
        else:
            body["text"] = c.full_text
            body["logprobs"] = self.completion_logprobs(c.logprobs, len(c.prefix), c) if want_logprobs else None
        return body

    # ---- stream chunks ----------------------------------------------------------------------

    def first_chunk(self, index: int, prefix: str = "") -> bytes | None:
        """Chat streams open each choice with its role; completions echo their prompt."""
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return sse(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]))
        if prefix:
            return sse(self._chunk([{"index": index, "text": prefix, "logprobs": None, "finish_reason": None}]))
        return None

    def delta_chunk(self, c: Choice, text: str, lps: list[TokenLogprobs], want_logprobs: bool,
                    offset: int) -> bytes:
        finished = c.finish_reason is not None
        if not finished and not (want_logprobs and lps):
            return self._text_chunk(c.index, text)
        if self.chat:
            choice = {"index": c.index, "delta": {"content": text} if text else {},
                      "logprobs": self.chat_logprobs(lps) if want_logprobs and lps else None,
                      "finish_reason": c.finish_reason}
        else:
            echo = c if c.prompt_logprobs is not None and not c.prompt_logprobs_sent else None
            c.prompt_logprobs_sent = c.prompt_logprobs_sent or echo is not None
            choice = {"index": c.index, "text": text,
                      "logprobs": self.completion_logprobs(lps, offset, echo) if want_logprobs and lps else None,
                      "finish_reason": c.finish_reason}
        if finished:
            choice["stop_reason"] = c.stop_reason
        return sse(self._chunk([choice]))

    def _text_chunk(self, index: int, text: str) -> bytes:
        """The common chunk (text, no logprobs, not the last) from pre-serialised parts."""
        head = self._heads.get(index)
        if head is None:
            body = self._chunk([{"index": index}])
            head = self._heads[index] = orjson.dumps(body)[:-3]  # up to the choice's closing "}]}"
        if self.chat:
            return b"data: " + head + b',"delta":{"content":' + orjson.dumps(text) + \
                b'},"logprobs":null,"finish_reason":null}]}\n\n'
        return b"data: " + head + b',"text":' + orjson.dumps(text) + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def usage_chunk(self, use: dict) -> bytes:
        body = self._chunk([])
        body["usage"] = use
        return sse(body)

    def _chunk(self, choices: list[dict]) -> dict:
        out = self._base("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = choices
        return out
