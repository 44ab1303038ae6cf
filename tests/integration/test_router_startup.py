"""Start-up over real processes: a router that comes up before its decode worker is not ready
(/ready 503, saying why) while only a prefill worker is in rotation, and a request sent then
waits for the decode worker instead of failing with 503."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready
from tests.integration.conftest import free_port, start_router

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "smollm2-135m-instruct"
ENGINE = ["--host", "127.0.0.1", "--model", MODEL, "--num-threads", "1", "--no-load-progress",
          "--kv-cache-memory-gb", "0.25"]


def ready(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/ready", timeout=10)
    return r.status_code, r.json()


def poll_ready_until(url: str, done, seconds: float) -> list[tuple[int, dict]]:
    """/ready answers, polled until ``done(status, body)``; the last one satisfies it."""
    import time

    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(ready(url))
        if done(*seen[-1]):
            return seen
        time.sleep(0.1)  # pacing between polls, not a wait for an event
    raise AssertionError(f"/ready never reached the state in {seconds} s: {seen[-3:]}")


def test_a_request_sent_before_the_decode_worker_is_up_waits_for_it():
    prefill = start_worker("prefill", [*ENGINE, "--port", "0"])
    workers, router = [prefill], None
    try:
        wait_ready([prefill], timeout_s=300)
        decode_address = f"127.0.0.1:{free_port()}"
        router, url = start_router([prefill.address, decode_address], MODEL, "--startup-wait-s", "600", ready=False)
        seen = poll_ready_until(url, lambda _, body: any(w["healthy"] for w in body["workers"]), 60)
        status, body = seen[-1]  # the prefill worker in rotation, no decode worker: not ready
        assert status == 503 and body["ready"] is False and "no decode worker in rotation" in body["reason"], body

        decode = start_worker("decode", [*ENGINE, "--port", decode_address.rsplit(":", 1)[1]])
        workers.append(decode)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, url + "/v1/chat/completions", timeout=600, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                "temperature": 0})
            seen = poll_ready_until(url, lambda status, _: status == 200, 600)
            r = answer.result(timeout=600)
        assert seen[0][0] == 503  # the request was in flight before the decode worker was in rotation
        assert all(status == 503 for status, _ in seen[:-1]) and seen[-1][1]["ready"] is True
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        wait_ready([decode], timeout_s=60)  # (reads its address line and keeps its output drained)
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        stop_workers(workers, grace_s=10)
