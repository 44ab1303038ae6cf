"""Plain-ASGI reading and writing for the router's endpoints: bodies within a limit, JSON, SSE.

The limit on a request body comes from the context length, so that a body no prompt could fit
is refused before it is read (a 50 MB body read, parsed and tokenised would hold the router for
minutes and gigabytes):

    limit = max(1 MiB, max_model_len x 128 bytes + 64 KiB)

128 bytes is a generous bound on one token's text as JSON: the longest token of the default
model's vocabulary is 82 bytes JSON-escaped (a run of 80 '#'), the mean under 7; a prompt given
as token ids takes at most 8 bytes a token ("123456, "). 64 KiB covers the rest of the body
(field names, sampling fields, message roles). Until a worker reports its context length, the
rule assumes 131072 tokens. ``RouterConfig.max_body_bytes`` replaces the rule with a fixed limit.
A batch of prompts shares one body: a batch past the limit is to be split by the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson

from pdserve.router.protocol import OpenAIError

BYTES_PER_TOKEN = 128
BODY_OVERHEAD = 64 << 10
MIN_BODY_LIMIT = 1 << 20
ASSUMED_CONTEXT = 131072


def body_limit(max_model_len: int | None, configured: int = 0) -> int:
    """The largest body accepted, in bytes (the rule in the module's docstring)."""
    if configured > 0:
        return configured
    return max(MIN_BODY_LIMIT, (max_model_len or ASSUMED_CONTEXT) * BYTES_PER_TOKEN + BODY_OVERHEAD)


def _too_large(size: int, limit: int, declared: bool) -> OpenAIError:
    what = f"{size} bytes" if declared else f"over {limit} bytes"
    return OpenAIError(413, f"the request body is {what}; the limit is {limit} bytes (from the model's context "
                            f"length, or --max-body-bytes)", code="request_too_large")


def header(scope, name: bytes) -> str | None:
    """A request header's value (``name`` lowercase, as ASGI gives names), None when absent."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def content_length(scope) -> int | None:
    """The declared body size, None when not declared (chunked); a malformed one is a 400."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise OpenAIError(400, "the Content-Length header is not a number") from None
    return None


async def read_body(scope, receive, limit: int) -> bytes:
    """The request body; past ``limit`` a 413, before reading when Content-Length says so."""
    declared = content_length(scope)
    if declared is not None and declared > limit:
        raise _too_large(declared, limit, declared=True)
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise OpenAIError(400, "the client closed the connection before sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:  # (the server discards the rest of the body after the answer)
            raise _too_large(size, limit, declared=False)
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


def _raw(headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]


async def send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = orjson.dumps(body)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers + _raw(headers)})
    await send({"type": "http.response.body", "body": data})


async def send_sse(send, receive, body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
    """Stream ``body``; a client disconnect cancels the streaming (and so the worker calls)."""
    task = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                *_raw(headers)]})
        async for chunk in body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # our own cancellation: the client left, nothing more to do
    finally:
        watcher.cancel()
        await body.aclose()
