"""OpenAI request bodies (pydantic) and the sampling parameters they mean.

Fields follow OpenAI's API, plus the extra sampling fields vLLM accepts (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, cache_salt). Unknown fields are refused, as OpenAI does; fields
OpenAI has that pdserve cannot honour are refused when set (never silently ignored).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams

# The wire (proto/v1) carries counts and token ids as int32 and seeds as int64: larger values are a
# 400 naming the field here, not an error building the worker request (found by tests/integration/test_fuzz.py).
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]

# Every step checks each unfinished request's new text against its stop strings: bounded here.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: Int32 | None = None  # vLLM's: the engine's scheduling order (lower first), within what the key allows

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.service_tier == "scale":
            raise ValueError("service_tier: 'scale' is not served; use auto, default, flex or priority")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in self.stops()):
            raise ValueError(f"stop: each stop sequence is at most {MAX_STOP_CHARS} characters")
        if self.stop_token_ids and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; its validation errors name the request field."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stops(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name"; kept for the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    def engine_params(self) -> SamplingParams:
        limit = self.max_completion_tokens or self.max_tokens
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them."""
    out = []
    for m in messages:
        extra = {k: v for k, v in (m.model_extra or {}).items() if isinstance(v, str)}
        out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text(), **extra})
    return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def engine_params(self) -> SamplingParams:
        params = self.sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs too (vLLM)
            params = params.replace(prompt_logprobs=self.logprobs)
        return params


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with messages, through the chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template holds the special tokens it wants
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


def field_of_engine_error(e: InvalidRequestError, request: _Sampling) -> str:
    """The request field behind an engine validation error (names differ in a few places)."""
    if e.field == "max_tokens" and isinstance(request, ChatCompletionRequest) and request.max_completion_tokens:
        return "max_completion_tokens"
    if e.field == "logprobs" and isinstance(request, ChatCompletionRequest):
        return "top_logprobs"
    if e.field == "prompt" and isinstance(request, ChatCompletionRequest):
        return "messages"
    return e.field


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """A request body as ``model``; a 400 naming the field when it is not one."""
    return _validate(model, _json_object(raw))


def parse_tokenize(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A ``/tokenize`` body: with ``messages``, a chat; else a prompt."""
    data = _json_object(raw)
    return _validate(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)


def _json_object(raw: bytes) -> dict:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise OpenAIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    return data


def _validate(model: type[BaseModel], data: dict) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: list) -> OpenAIError:
    """A pydantic validation error as a 400 naming the field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not isinstance(x, int)]
    param = loc[0] if loc else None
    message = str(err.get("msg", "invalid request"))
    if err.get("type") == "json_invalid":
        param, message = None, "the request body is not valid JSON"
    elif not loc and err.get("type") in ("model_attributes_type", "dict_type"):
        message = "the request body must be a JSON object"
    elif not loc:  # a model validator: its message names the field first ("field: ...")
        message = message.removeprefix("Value error, ")
        if ":" in message:
            param = message.split(":", 1)[0].split()[0]
    text = f"{'.'.join(loc)}: {message}" if loc else message
    return OpenAIError(400, text, param=param)
