"""Sending a workload to a server and timing every request.

    items = build_workload(config, tokenizer)
    result = await run(config, items, rate=config.request_rate)   # RunResult: records + duration

Arrivals follow the configured process (Poisson, gamma with a burstiness factor, constant) at
the rate, capped by ``max_concurrency``; with an infinite rate and a concurrency cap the
clients form a closed loop. Every request streams, with ``stream_options.include_usage``, so
TTFT and inter-token gaps are measured per chunk and the server's token count is checked.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import orjson
from tqdm import tqdm

from pdserve.bench.config import BenchConfig
from pdserve.bench.http import HTTPClient, HTTPError
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import (
    WorkItem,
    chat_workload,
    conversational_workload,
    jsonl_workload,
    prefix_workload,
    random_workload,
)


class ServerUnreachable(RuntimeError):
    """The server did not answer at all (refused, unknown host, no HTTP)."""


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # from the first measured request sent to the last one finished
    rate: float


def vocab_range(tokenizer) -> tuple[int, int]:
    """Token ids safe to sample for random prompts: above the usual special-token block."""
    return (min(100, tokenizer.vocab_size // 2), tokenizer.vocab_size - len(tokenizer.info.special_tokens) - 8)


def build_workload(config: BenchConfig, tokenizer) -> list[WorkItem]:
    items = _workload(config, tokenizer)
    if config.max_output_len:
        for item in items:
            item.output_len = min(item.output_len or config.max_output_len, config.max_output_len)
    return items


def _workload(config: BenchConfig, tokenizer) -> list[WorkItem]:
    n, seed = config.num_prompts, config.seed
    if config.duration and config.request_rate != math.inf:
        n = max(n, int(config.request_rate * config.duration * 1.5) + 10)
    n += config.warmup_requests
    vocab = vocab_range(tokenizer)
    name = config.dataset_name
    if name == "random":
        return random_workload(n, config.random_input_len, config.random_output_len, config.random_range_ratio,
                               vocab, seed)
    if name == "prefix":
        return prefix_workload(n, config.prefix_num, config.prefix_len, config.suffix_len, config.random_output_len,
                               vocab, seed)
    if name == "chat":
        return chat_workload(-(-n // config.chat_turns), config.chat_turns, config.chat_user_words,
                             config.random_output_len, seed)
    if name == "jsonl":
        return jsonl_workload(config.dataset_path, n, seed)
    return conversational_workload(n, vocab, seed)


def arrival_offsets(count: int, rate: float, kind: str, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``count`` requests."""
    if rate == math.inf:
        return [0.0] * count
    rng = random.Random(seed + 7919)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        if kind == "constant":
            t += 1.0 / rate
        elif kind == "gamma":
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        else:
            t += rng.expovariate(rate)
    return out


async def server_model(client: HTTPClient) -> str:
    try:
        status, body = await client.request("GET", "/v1/models")
    except OSError as e:
        raise ServerUnreachable(f"cannot reach the server at {client.host}:{client.port}: {e.strerror or e}") from e
    if status != 200:
        raise ServerUnreachable(f"GET /v1/models answered {status}: {body[:200].decode(errors='replace')}")
    models = orjson.loads(body).get("data") or []
    if not models:
        raise ServerUnreachable("the server lists no models; pass --model")
    return models[0]["id"]


class Runner:
    def __init__(self, config: BenchConfig, client: HTTPClient, model: str, tokenizer):
        self.config = config
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self._bar = None
        self._measured_start: float | None = None
        self._measured_end = 0.0

    async def run(self, items: list[WorkItem], rate: float) -> RunResult:
        c = self.config
        chat = c.dataset_name == "chat"
        requests_per_item = c.chat_turns if chat else 1
        offsets = arrival_offsets(len(items), rate, c.arrival_kind(), c.burstiness, c.seed)
        limit = asyncio.Semaphore(c.max_concurrency) if c.max_concurrency else None
        total = len(items) * requests_per_item
        self._bar = tqdm(total=total, desc=f"bench {c.dataset_name} @ {rate:g} req/s", unit="req",
                         disable=not c.progress, leave=False)
        self.t0 = time.perf_counter()
        tasks = []
        for k, (item, offset) in enumerate(zip(items, offsets)):
            if c.duration and offset > c.duration:
                break
            delay = self.t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            warm = k * requests_per_item < c.warmup_requests
            job = self._conversation(k, item, warm) if chat else self._one(k, item, warm)
            tasks.append(asyncio.create_task(self._limited(limit, job)))
        try:
            await asyncio.gather(*tasks)
        finally:
            self._bar.close()
        start = self._measured_start if self._measured_start is not None else self.t0
        return RunResult(sorted(self.records, key=lambda r: r.index), max(self._measured_end - start, 1e-9), rate)

    @staticmethod
    async def _limited(limit: asyncio.Semaphore | None, job) -> None:
        if limit is None:
            await job
            return
        async with limit:
            await job

    async def _conversation(self, k: int, item: WorkItem, warm: bool) -> None:
        history: list[dict] = []
        for t, turn in enumerate(item.turns):
            messages = history + [{"role": "user", "content": turn}]
            work = WorkItem(messages=messages, output_len=item.output_len)
            record = await self._one(k * len(item.turns) + t, work, warm, keep_text=True)
            if not record.ok:
                return  # a conversation cannot go on without its answer
            history = messages + [{"role": "assistant", "content": record.text or ""}]
            if not self.config.save_text:
                record.text = None

    def _body(self, item: WorkItem) -> tuple[str, bytes]:
        c = self.config
        chat = item.messages is not None or c.endpoint == "/v1/chat/completions"
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "temperature": c.temperature}
        if item.output_len is not None:
            body["max_tokens"] = item.output_len
            if c.ignore_eos:
                body["ignore_eos"] = True
        if chat:
            prompt = item.prompt if not isinstance(item.prompt, list) else self.tokenizer.decode(item.prompt)
            body["messages"] = item.messages or [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", orjson.dumps(body)
        body["prompt"] = item.prompt
        return "/v1/completions", orjson.dumps(body)

    async def _one(self, index: int, item: WorkItem, warm: bool, keep_text: bool = False) -> RequestRecord:
        path, body = self._body(item)
        record = RequestRecord(index=index, start=time.perf_counter() - self.t0, input_tokens=item.input_len,
                               requested_output_tokens=item.output_len or 0, start_wall=time.time(), warmup=warm)
        if not warm and self._measured_start is None:
            self._measured_start = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await self._stream(path, body, record, keep_text)
        except HTTPError as e:
            record.error = f"http_{e.status}"
        except TimeoutError:
            record.error = "timeout"
        except (OSError, asyncio.IncompleteReadError) as e:
            record.error = "connection_refused" if isinstance(e, ConnectionRefusedError) else "connection"
        except (ValueError, KeyError, IndexError):
            record.error = "bad_response"
        record.ok = record.error is None
        if not warm:
            self._measured_end = max(self._measured_end, time.perf_counter())
        self.records.append(record)
        self._bar.update(1)
        return record

    async def _stream(self, path: str, body: bytes, record: RequestRecord, keep_text: bool) -> None:
        last = sent = None
        text = []
        async for t, data in self.client.stream_events(path, body):
            if data is None:  # the request's bytes were just written: the clock starts
                sent = t
                record.start = t - self.t0
                record.start_wall = time.time()
                continue
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                record.error = "stream_error"
                return
            usage = chunk.get("usage")
            if usage:
                record.usage_tokens = usage.get("completion_tokens")
                record.input_tokens = usage.get("prompt_tokens", record.input_tokens)
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or ():
                piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                if not piece:
                    continue
                if last is None:
                    record.ttft = t - sent
                else:
                    record.itl.append(t - last)
                last = t
                record.stream_chunks += 1
                if keep_text or self.config.save_text:
                    text.append(piece)
        record.latency = time.perf_counter() - sent
        record.output_tokens = record.usage_tokens if record.usage_tokens is not None else record.stream_chunks
        if text:
            record.text = "".join(text)
        if record.ttft is None:
            record.error = "no_tokens"
