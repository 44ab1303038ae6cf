"""A real router under large bodies: one too large for the context is refused (413) before it is
read, a large one that is allowed is parsed and tokenised off the event loop, and /health answers
throughout (it once went unanswered for minutes under one 50 MB body)."""

from __future__ import annotations

import random
import string
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "smollm2-135m-instruct"
HEALTH_BOUND_S = 2.0  # generous: /health takes milliseconds when the loop is free


class HealthPoller(threading.Thread):
    """Asks /health every 50 ms until stopped; keeps (sent at, latency, status) of each."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.polls: list[tuple[float, float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while True:
                sent = time.monotonic()
                status = client.get(self.base_url + "/health").status_code
                self.polls.append((sent, time.monotonic() - sent, status))
                if self.stop.wait(0.05):
                    return

    def __enter__(self) -> HealthPoller:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(90)

    def answered_between(self, start: float, end: float) -> list[float]:
        return [latency for sent, latency, status in self.polls if sent >= start and sent + latency <= end
                and status == 200]

    def worst(self) -> float:
        assert all(status == 200 for _, _, status in self.polls)
        return max(latency for _, latency, _ in self.polls)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def random_text(size: int) -> str:
    rng = random.Random(0)  # words the tokenizer has not cached: its slowest case
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(50000)]
    return " ".join(rng.choices(words, k=size // 4))[:size]


def test_a_large_allowed_body_leaves_health_answering(served):
    # ~1 MB of text (under the default model's 1.06 MiB limit) is ~600k tokens: tokenised, then
    # refused as over the context, while /health keeps answering.
    body = {"model": MODEL, "messages": [{"role": "user", "content": random_text(1_000_000)}]}
    with HealthPoller(served.base_url) as poller:
        start = time.monotonic()
        r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=120)
        end = time.monotonic()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert poller.answered_between(start, end), "no /health answer while the request was processed"
    assert poller.worst() < HEALTH_BOUND_S, poller.polls


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_too_large_for_the_context_is_413_before_it_is_read(served, declared):
    blob = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + \
        b"word " * (10 << 20) + b'"}]}'  # 50 MB
    content = blob if declared else (blob[i:i + (1 << 20)] for i in range(0, len(blob), 1 << 20))
    before = rss_mb(served.router.pid)
    with HealthPoller(served.base_url) as poller:
        start = time.monotonic()
        r = httpx.post(served.base_url + "/v1/chat/completions", content=content, timeout=60,
                       headers={"content-type": "application/json"})
        elapsed = time.monotonic() - start
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and set(err) == {"message", "type", "param", "code"}
    assert "limit is" in err["message"]
    assert elapsed < 30
    assert rss_mb(served.router.pid) - before < 100  # the body was never held
    assert poller.worst() < HEALTH_BOUND_S, poller.polls
    ok = httpx.post(served.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200  # and the connection's next request is served as usual
