"""A small HTTP/1.1 client for load generation: keep-alive connections, streamed SSE events,
each stamped with the moment its last byte arrived.

General-purpose clients (httpx) spend tens of microseconds per streamed event in Python, and
stamp an event when the reading task gets to run, which under load is a loop iteration (up to
milliseconds) after the bytes came in. Here each connection is an ``asyncio.Protocol``: bytes
are stamped in ``data_received``, as the event loop reads them, and the request's send time is
taken as its bytes are written.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A response with a status other than 200; ``body`` holds what the server said."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status
        self.body = body


class _Conn(asyncio.Protocol):
    """One connection: received bytes with the time each piece arrived."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.arrivals: deque[tuple[int, float]] = deque()  # (end offset in buf, perf_counter)
        self.waiter: asyncio.Future | None = None
        self.lost: BaseException | None = None
        self.eof = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.arrivals.append((len(self.buf), time.perf_counter()))
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc) -> None:
        self.eof = True
        self.lost = exc
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    @property
    def usable(self) -> bool:
        return not self.eof and self.transport is not None and not self.transport.is_closing()

    async def _more(self) -> None:
        if self.eof:
            raise ConnectionResetError("the server closed the connection") from self.lost
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def _take(self, n: int) -> tuple[bytes, float]:
        """The first ``n`` buffered bytes and when the last of them arrived."""
        data = bytes(self.buf[:n])
        stamp = next(t for end, t in self.arrivals if end >= n)
        del self.buf[:n]
        self.arrivals = deque((end - n, t) for end, t in self.arrivals if end > n)
        return data, stamp

    async def read_until(self, sep: bytes) -> tuple[bytes, float]:
        while (i := self.buf.find(sep)) < 0:
            await self._more()
        return self._take(i + len(sep))

    async def read_exactly(self, n: int) -> tuple[bytes, float]:
        while len(self.buf) < n:
            await self._more()
        return self._take(n)

    async def read_to_eof(self) -> bytes:
        while not self.eof:
            await self._more()
        data = bytes(self.buf)
        self.buf.clear()
        return data


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
            c.transport.close()
        self._idle.clear()

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _connect(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout):
            _, conn = await loop.create_connection(_Conn, self.host, self.port)
        return conn

    def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: keep-alive"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")

    @staticmethod
    async def _head(conn: _Conn) -> tuple[int, dict[str, str]]:
        raw, _ = await conn.read_until(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return status, headers

    @staticmethod
    async def _chunks(conn: _Conn, headers: dict[str, str]) -> AsyncIterator[tuple[bytes, float]]:
        """The body's pieces, each with the arrival time of its last byte."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line, _ = await conn.read_until(b"\r\n")
                size = int(line.split(b";")[0], 16)
                data, stamp = await conn.read_exactly(size + 2)
                if size == 0:
                    return
                yield data[:-2], stamp
        elif "content-length" in headers:
            yield await conn.read_exactly(int(headers["content-length"]))
        else:
            yield await conn.read_to_eof(), time.perf_counter()

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """A whole response: ``(status, body)``."""
        conn = await self._connect()
        ok = False
        try:
            async with asyncio.timeout(self.timeout):
                conn.transport.write(self._request(method, path, body))
                status, headers = await self._head(conn)
                data = b"".join([c async for c, _ in self._chunks(conn, headers)])
            ok = headers.get("connection", "").lower() != "close"
            return status, data
        finally:
            self._release(conn, ok)

    async def stream_events(self, path: str, body: bytes) -> AsyncIterator[tuple[float, bytes | None]]:
        """POST; yield ``(perf_counter when the request was written, None)``, then
        ``(perf_counter when it arrived, payload)`` for each ``data:`` event.

        A non-200 answer raises ``HTTPError`` before any event.
        """
        conn = await self._connect()
        ok = False
        try:
            conn.transport.write(self._request("POST", path, body))
            yield time.perf_counter(), None
            status, headers = await self._head(conn)
            if status != 200:
                data = b"".join([c async for c, _ in self._chunks(conn, headers)])
                ok = True
                raise HTTPError(status, data)
            buffer = b""
            async for chunk, stamp in self._chunks(conn, headers):
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            yield stamp, line[6:]
            ok = True
        finally:
            self._release(conn, ok)

    def _release(self, conn: _Conn, reusable: bool) -> None:
        if reusable and conn.usable and not conn.buf:
            self._idle.append(conn)
        else:
            conn.transport.close()
