"""A timing-only OpenAI-compatible server, for benchmarking the load generator: NOT A MODEL.

    python -m pdserve.bench.mock_server --port 8100 --tokens-per-s 1000

``/v1/completions`` and ``/v1/chat/completions`` stream ``max_tokens`` made-up tokens at a fixed
rate. Each token's text is a stamp: the first ``"<r=RECEIVED><t=SENT>"``, the rest
``"<t=SENT>"`` (``time.time()`` seconds), so a client on the same machine can compare its own
TTFT with the server's. Usage is reported when asked. ``GET /v1/models`` lists one model;
``GET /stats`` counts the streams answered to the end (``{"completed": N}``), which tests wait on.

It speaks HTTP/1.1 straight off an ``asyncio.Protocol`` (keep-alive, chunked responses), so
its stamps are taken within microseconds of the bytes arriving and leaving: what a client
measures beyond them is the client's own overhead plus the loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson

MODEL = "timing-only-mock"


class _Counts:
    """What every connection of one server adds to."""

    def __init__(self) -> None:
        self.completed = 0


class _Conn(asyncio.Protocol):
    def __init__(self, gap: float, counts: _Counts):
        self.gap = gap
        self.counts = counts
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        received = time.time()
        self.buffer += data
        while not self.busy:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            method, path = head[0].split()[:2]
            self.busy = True
            asyncio.get_running_loop().create_task(self._answer(method, path, body, received))

    async def _answer(self, method: str, path: str, body: bytes, received: float) -> None:
        try:
            if method == "GET" and path == "/v1/models":
                self._whole(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif method == "GET" and path == "/stats":
                self._whole(200, {"completed": self.counts.completed})
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(path == "/v1/chat/completions", orjson.loads(body), received)
            else:
                self._whole(404, {"error": {"message": f"{method} {path}: not found", "type": "not_found_error",
                                            "param": None, "code": None}})
        finally:
            self.busy = False
            if self.buffer and not self.transport.is_closing():
                self.data_received(b"")

    def _whole(self, status: int, body: dict) -> None:
        data = orjson.dumps(body)
        self.transport.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: "
                             f"{len(data)}\r\n\r\n".encode() + data)

    def _chunk(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n" % len(data) + data + b"\r\n")

    async def _stream(self, chat: bool, req: dict, received: float) -> None:
        n = int(req.get("max_tokens") or 16)
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        start = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i * self.gap - time.monotonic()))
            if self.transport.is_closing():
                return
            stamp = (f"<r={received:.6f}>" if i == 0 else "") + f"<t={time.time():.6f}>"
            choice = {"index": 0, "delta": {"content": stamp}} if chat else {"index": 0, "text": stamp}
            choice["finish_reason"] = "length" if i == n - 1 else None
            chunk = {"id": "mock", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                     "model": MODEL, "choices": [choice]}
            self._chunk(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if (req.get("stream_options") or {}).get("include_usage"):
            prompt = req.get("prompt")
            p = len(prompt) if isinstance(prompt, list) else 0
            usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
            self._chunk(b"data: " + orjson.dumps({"id": "mock", "choices": [], "usage": usage}) + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self.transport.write(b"0\r\n\r\n")
        self.counts.completed += 1


def parse_stamps(text: str) -> tuple[float | None, list[float]]:
    """(received, [sent, ...]) from a response text made of stamps."""
    received = None
    sent = []
    for part in text.replace(">", "").split("<")[1:]:
        key, _, value = part.partition("=")
        if key == "r":
            received = float(value)
        elif key == "t":
            sent.append(float(value))
    return received, sent


async def serve(host: str, port: int, tokens_per_s: float) -> None:
    loop = asyncio.get_running_loop()
    counts = _Counts()
    server = await loop.create_server(lambda: _Conn(1.0 / tokens_per_s, counts), host, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    p.add_argument("--tokens-per-s", type=float, default=1000.0, help="tokens per second per stream (default: 1000)")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port, args.tokens_per_s))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
