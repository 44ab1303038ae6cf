"""Requests whose bytes are not the method's message: INVALID_ARGUMENT, before a servicer sees them.

grpc.aio parses a request with the method's deserializer before the servicer runs; bytes that do not
parse end the call UNKNOWN ("Unexpected DecodeError") and log a traceback, one per call, so anyone
who can reach a worker can fill its log. ``MalformedMessages`` gives each handler raw bytes and
parses them itself: a request (or a streamed chunk) that does not parse ends the call
INVALID_ARGUMENT, its details the JSON every refusal of a worker carries (``convert.encode_invalid``:
field ``request``, code ``malformed_message``, the message type), logged once a minute at most.
"""

from __future__ import annotations

import inspect
import json
import logging
import time

import grpc

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0


class MalformedMessages(grpc.aio.ServerInterceptor):
    """Server side: the method's handler, fed only messages that parsed."""

    def __init__(self) -> None:
        self.refused = 0
        self._logged_at = -LOG_EVERY_S

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._parsing(handler, handler_call_details.method)

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

    def _parsing(self, handler, method: str):
        parse = handler.request_deserializer

        async def parsed(raw: bytes, context):
            try:
                return parse(raw)
            except Exception as e:  # protobuf's DecodeError; whatever a deserializer raises on junk
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._refuse_details(method, parse, e))

        async def requests(raw_iterator, context):
            async for raw in raw_iterator:
                yield await parsed(raw, context)

        async def answer(behavior, request, context):
            result = behavior(request, context)  # the generated base's unimplemented methods are plain functions
            return await result if inspect.isawaitable(result) else result

        async def stream(behavior, request, context):
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
            if hasattr(result, "__aiter__"):
                async for response in result:
                    yield response
            else:
                for response in result:
                    yield response

        serializer = handler.response_serializer
        if not handler.request_streaming and not handler.response_streaming:
            async def unary_unary(raw, context):
                return await answer(handler.unary_unary, await parsed(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serializer)
        if not handler.request_streaming:
            async def unary_stream(raw, context):
                async for response in stream(handler.unary_stream, await parsed(raw, context), context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serializer)
        if not handler.response_streaming:
            async def stream_unary(raw_iterator, context):
                return await answer(handler.stream_unary, requests(raw_iterator, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serializer)

        async def stream_stream(raw_iterator, context):
            async for response in stream(handler.stream_stream, requests(raw_iterator, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serializer)
