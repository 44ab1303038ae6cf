"""A small HTTP/1.1 client for load generation: keep-alive connections, streamed SSE events,
each stamped with the moment its bytes were read.

General-purpose clients (httpx) spend tens of microseconds per streamed event in Python; at
10,000 events/s that is most of a core and milliseconds of queueing, which would be measured
as server latency. This one reads chunked bodies straight off ``asyncio`` streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A response with a status other than 200; ``body`` holds what the server said."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status
        self.body = body


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer


class HTTPClient:
    def __init__(self, base_url: str, timeout: float = 600.0):
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"base_url: only http:// is supported, got {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._idle: list[_Conn] = []

    async def close(self) -> None:
        for c in self._idle:
            c.writer.close()
        self._idle.clear()

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _connect(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout)
        return _Conn(reader, writer)

    def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: keep-alive"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")

    async def _head(self, conn: _Conn) -> tuple[int, dict[str, str]]:
        raw = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), self.timeout)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return status, headers

    async def _chunks(self, conn: _Conn, headers: dict[str, str]) -> AsyncIterator[bytes]:
        reader = conn.reader
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await asyncio.wait_for(reader.readline(), self.timeout)).split(b";")[0], 16)
                data = await asyncio.wait_for(reader.readexactly(size + 2), self.timeout)
                if size == 0:
                    return
                yield data[:-2]
        elif "content-length" in headers:
            yield await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), self.timeout)
        else:
            yield await asyncio.wait_for(reader.read(), self.timeout)

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """A whole response: ``(status, body)``."""
        conn = await self._connect()
        ok = False
        try:
            conn.writer.write(self._request(method, path, body))
            status, headers = await self._head(conn)
            data = b"".join([c async for c in self._chunks(conn, headers)])
            ok = headers.get("connection", "").lower() != "close"
            return status, data
        finally:
            self._release(conn, ok)

    async def stream_events(self, path: str, body: bytes) -> AsyncIterator[tuple[float, bytes]]:
        """POST and yield ``(perf_counter when read, payload)`` for each ``data:`` event.

        A non-200 answer raises ``HTTPError`` before any event.
        """
        conn = await self._connect()
        ok = False
        try:
            conn.writer.write(self._request("POST", path, body))
            status, headers = await self._head(conn)
            if status != 200:
                data = b"".join([c async for c in self._chunks(conn, headers)])
                ok = True
                raise HTTPError(status, data)
            buffer = b""
            async for chunk in self._chunks(conn, headers):
                now = time.perf_counter()
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            yield now, line[6:]
            ok = True
        finally:
            self._release(conn, ok)

    def _release(self, conn: _Conn, reusable: bool) -> None:
        if reusable:
            self._idle.append(conn)
        else:
            conn.writer.close()
