"""Requests whose bytes are not the method's message: INVALID_ARGUMENT, before a servicer sees them.

grpc.aio parses a request with the method's deserializer before the servicer runs; bytes that do not
parse end the call UNKNOWN ("Unexpected DecodeError") and log a traceback, one per call, so anyone
who can reach a worker can fill its log. ``MalformedMessages`` gives each handler raw bytes and
parses them itself: a request (or a streamed chunk) that does not parse ends the call
INVALID_ARGUMENT, its details the JSON every refusal of a worker carries (``convert.encode_invalid``:
field ``request``, code ``malformed_message``, the message type), logged once a minute at most.
"""

from __future__ import annotations

import json
import logging
import time

import grpc

from pdserve.cluster_token import same_kind

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0


class MalformedMessages(grpc.aio.ServerInterceptor):
    """Server side: the method's handler, fed only messages that parsed (built once per method)."""

    def __init__(self) -> None:
        self.refused = 0
        self._logged_at = -LOG_EVERY_S
        self._parsing: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        if method not in self._parsing:
            self._parsing[method] = self._parse_first(handler, method)
        return self._parsing[method]

    def _refuse_details(self, method: str, parse, error: Exception) -> str:
        message_type = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        name = message_type.full_name if message_type is not None else "request"
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("%s: refused a request that is not a %s message (%d refused so far): %s", method, name,
                        self.refused, error)
        return json.dumps({"field": "request", "code": "malformed_message",
                           "message": f"{method}: the request is not a valid {name} message: {error}"})

    def _parse_first(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` given raw bytes, parsing them itself. Its behaviour is an async function or an
        async generator; the generated base class's methods for what a role lacks are plain functions
        that raise UNIMPLEMENTED when called, before anything is awaited."""
        parse = handler.request_deserializer

        async def parsed(raw: bytes, context):
            try:
                return parse(raw)
            except Exception as e:  # protobuf's DecodeError; whatever a deserializer raises on junk
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._refuse_details(method, parse, e))

        async def requests(raw_iterator, context):
            async for raw in raw_iterator:
                yield await parsed(raw, context)

        streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
        behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

        async def request_of(raw, context):
            return requests(raw, context) if streaming_in else await parsed(raw, context)

        if streaming_out:
            async def answer_stream(raw, context):
                async for response in behavior(await request_of(raw, context), context):
                    yield response

            return same_kind(handler, answer_stream, None)

        async def answer(raw, context):
            return await behavior(await request_of(raw, context), context)

        return same_kind(handler, answer, None)
