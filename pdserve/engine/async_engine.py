"""The engine behind an asyncio API: its step loop runs in a thread of its own.

    engine = AsyncEngine(lambda: LLMEngine(config))   # or an LLMEngine already built
    engine.start()                                    # (await engine.start_async() in a running loop)
    async for out in engine.generate("id", prompt_ids, params):   # RequestOutput deltas
        ...
    engine.abort("id")           # from any task; also done when the consumer stops iterating

Requests are validated in the caller's task (bad input raises at once); the loop thread owns
the LLMEngine: it adds queued requests, applies aborts, steps while there is work, and hands
each step's outputs to the event loop in one call.

Given a factory, the loop thread builds the engine itself, and the thread that starts it is kept
off OpenMP (``cpu_kernels.keep_thread_serial``): on CPU the thread that loads the model (and warms
its kernels up) then is the one that steps it, the process's only OpenMP team. An engine loaded
in one thread and stepped in another leaves two teams; GNU OpenMP, seeing more of its threads than
cores, then puts the stepping team to sleep between parallel regions (a 2-core decode step 28 ->
43 ms, which served a TPOT of ~105 ms where ~70 was the engine's).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from pdserve.engine.engine import EngineStats, LLMEngine
from pdserve.engine.request import Request, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception in a step); no request can complete."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], rate_window_s: float = 5.0):
        """``engine``: the engine, or a factory the loop thread calls on ``start`` (see the module)."""
        if isinstance(engine, LLMEngine):
            self.engine, self._factory = engine, None
        else:
            self.engine, self._factory = None, engine
        self._built = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._stats = self.engine.stats() if self.engine is not None else None
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_window_s = rate_window_s
        self.error: BaseException | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread; with a factory, return once it has built the engine (raising what
        building it raised)."""
        self._start()
        self._built.wait()
        self._check_built()

    async def start_async(self) -> None:
        """``start`` without blocking the running event loop while a factory loads the model."""
        self._start()
        await asyncio.get_running_loop().run_in_executor(None, self._built.wait)
        self._check_built()

    def _start(self) -> None:
        if self._factory is not None:
            from pdserve.engine.cpu_kernels import keep_thread_serial

            keep_thread_serial()  # this thread serves the event loop; the model's work is the loop thread's
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def _check_built(self) -> None:
        if self.engine is None:
            raise EngineDeadError(f"building the engine failed: {self.error!r}") from self.error

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests -----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        output_token_ids: list[int] = (), emitted_text_len: int | None = None, handoff_after: int | None = None,
        start_within_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request until it finishes; leaving early aborts it.

        ``output_token_ids``, ``emitted_text_len``: what was generated and sent elsewhere;
        ``handoff_after``: stop after this many tokens, the request continuing elsewhere;
        ``start_within_s``: the bound on its unstarted wait (see LLMEngine.make_request).
        """
        self._check_alive()
        with self._lock:
            self._check_free(request_id)
            request = self.engine.make_request(request_id, prompt, params, cache_salt,
                                               output_token_ids=output_token_ids, emitted_text_len=emitted_text_len,
                                               handoff_after=handoff_after, start_within_s=start_within_s)
            stream = self._open(request_id)
        self._commands.put(("add", request))
        self._wake.set()
        async for out in self._drain(request_id, stream):
            yield out

    async def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> tuple[list[int], int, list[list[int]] | None] | None:
        """Reserve blocks for a prompt whose KV will be written from outside.

        Returns (block ids, tokens already cached here, every layer group's block ids or None with
        one group), or None when there is no room.
        """
        self._check_alive()
        with self._lock:
            self._check_free(request_id)
            request = self.engine.make_request(request_id, prompt, params, cache_salt)
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("reserve", (request, future)))
        self._wake.set()
        return await future

    async def resume(self, request_id: str, kv_ok: bool, output_token_ids: list[int],
                     emitted_text_len: int | None = None,
                     start_within_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a reserved request: its KV landed (``kv_ok``) or it computes its prompt here
        (``start_within_s``: as generate's)."""
        self._check_alive()
        with self._lock:
            self._check_free(request_id)
            stream = self._open(request_id)
        self._commands.put(("resume", (request_id, kv_ok, list(output_token_ids), emitted_text_len, start_within_s,
                                       stream)))
        self._wake.set()
        async for out in self._drain(request_id, stream):
            yield out

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the engine's thread between steps (e.g. a consistent ``BlockPool.snapshot``)."""
        self._check_alive()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        return await future

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine loop stopped: {self.error!r}")

    def _check_free(self, request_id: str) -> None:
        if request_id in self._streams:
            from pdserve.engine.sampling_params import InvalidRequestError

            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")

    def _open(self, request_id: str) -> _Stream:
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self._streams[request_id] = stream
        return stream

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"engine loop stopped: {out!r}") from out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def generation_rate(self) -> float:
        """Generated tokens per second over the recent window."""
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._rate_window_s:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._rate_window_s

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # ---- the loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.engine is None:
                try:
                    self.engine = self._factory()
                    self._stats = self.engine.stats()
                except BaseException as e:  # start() raises it
                    self.error = e
                    log.exception("building the engine failed")
                    self._built.set()
                    return
            self._built.set()
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as e:  # the loop must not die silently: fail every waiting request
            log.exception("engine loop failed")
            self.error = e
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request: Request = arg
                with self._lock:
                    live = request.request_id in self._streams
                if live:  # the caller may have gone before its request got here
                    self.engine.add(request)
            elif kind == "reserve":
                request, future = arg
                blocks = self.engine.reserve_remote_request(request)
                result = None if blocks is None else (
                    blocks, request.num_computed_tokens, self.engine.kv.group_block_ids(request.request_id))
                future.get_loop().call_soon_threadsafe(_resolve, future, result)
            elif kind == "resume":
                self._resume(*arg)
            elif kind == "call":
                self._call(*arg)
            else:
                self._deliver(self.engine.abort_request(arg))

    def _call(self, fn: Callable, future: asyncio.Future) -> None:
        try:
            result = fn()
        except Exception as e:  # the caller's failure, not the loop's
            future.get_loop().call_soon_threadsafe(_fail, future, e)
            return
        future.get_loop().call_soon_threadsafe(_resolve, future, result)

    def _resume(self, request_id: str, kv_ok: bool, output_token_ids: list[int], emitted_text_len: int | None,
                start_within_s: float | None, stream: _Stream) -> None:
        if request_id not in self.engine.scheduler.remote:  # the lease ran out first: nothing to resume
            aborted = _aborted(request_id, "the KV reservation expired before the request resumed")
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, aborted)
            return
        self.engine.finish_remote_kv(request_id, kv_ok, output_token_ids, emitted_text_len, start_within_s)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        tokens = 0
        with self._lock:
            for out in outputs:
                tokens += len(out.new_token_ids)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
            self._recent.append((time.monotonic(), tokens))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def _aborted(request_id: str, why: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[], new_text="", finished=True, finish_reason="abort",
                         stop_reason=why)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
