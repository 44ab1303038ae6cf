"""The OpenAPI schema of the endpoints the router serves as plain ASGI.

``/v1/chat/completions``, ``/v1/completions``, ``/tokenize`` and ``/detokenize`` never reach
FastAPI (router/app.py serves them below it, for speed); declaring them here puts their request
bodies (the same pydantic models that parse them) in ``/openapi.json``, for clients, generators
and the fuzzing test (tests/router/test_fuzz.py). These handlers are never called.
"""

from __future__ import annotations

from fastapi import FastAPI

from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

_NEVER = "served as plain ASGI by the router; this handler only documents the body"


async def chat_completions(body: ChatCompletionRequest) -> dict:
    raise RuntimeError(_NEVER)


async def completions(body: CompletionRequest) -> dict:
    raise RuntimeError(_NEVER)


async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    raise RuntimeError(_NEVER)


async def detokenize(body: DetokenizeRequest) -> dict:
    raise RuntimeError(_NEVER)


def document_plain_routes(app: FastAPI) -> None:
    for path, handler, summary in (
            ("/v1/chat/completions", chat_completions, "OpenAI chat completions (stream: SSE)"),
            ("/v1/completions", completions, "OpenAI completions (stream: SSE)"),
            ("/tokenize", tokenize, "vLLM's /tokenize"),
            ("/detokenize", detokenize, "vLLM's /detokenize")):
        app.add_api_route(path, handler, methods=["POST"], summary=summary,
                          responses={400: {"description": "invalid request, OpenAI's error shape"},
                                     401: {"description": "no or a wrong API key"},
                                     429: {"description": "over a budget or the router's limit"}})
