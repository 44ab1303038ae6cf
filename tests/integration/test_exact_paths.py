"""Stop strings, held-back text, min_tokens and logprobs over every serving path: colocated,
disaggregated (the prefill worker hands off after the first token), disaggregated with
speculative decoding on the decode worker, and migrated (a decode worker lost mid-stream).
Each answer equals colocated serving's, field by field."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port, start_cluster, stop_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "smollm2-135m-instruct"
# Every prompt goes to the prefill worker, also when the decode worker has it cached.
DISAGG = ["--disagg-min-prompt-tokens", "16", "--disagg-min-uncached-tokens", "0", "--no-cost-contention"]
ENGINE = ["--kv-cache-memory-gb", "0.25"]
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea."]


def chat(url: str, question: str, stream: bool = False, **kw) -> dict:
    """One choice's answer: text, finish and stop reason, logprob tokens and values, completion tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 40,
            "temperature": 0, **kw}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        data = r.json()
        c = data["choices"][0]
        lps = (c["logprobs"] or {}).get("content") or []
        return {"text": c["message"]["content"], "finish": c["finish_reason"], "stop": c["stop_reason"],
                "lp_tokens": [x["token"] for x in lps], "lp": [round(x["logprob"], 3) for x in lps],
                "tokens": data["usage"]["completion_tokens"]}
    body["stream"], body["stream_options"] = True, {"include_usage": True}
    text, finish, stop, tokens = "", None, None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                if c["finish_reason"]:
                    finish, stop = c["finish_reason"], c.get("stop_reason")
    return {"text": text, "finish": finish, "stop": stop, "tokens": tokens}


def cases(url: str) -> list[tuple[str, dict]]:
    """Requests whose stop strings are cut from colocated greedy answers: one that is the first
    token's text, one spanning the first two tokens, one later; with include_stop_str_in_output,
    min_tokens and logprobs."""
    out = []
    for q in QUESTIONS:
        ref = chat(url, q, logprobs=True)
        toks = ref["lp_tokens"]
        first, full = toks[0], ref["text"]
        across = full[len(first) - 1 : len(first) + 2]
        later = full[len(first) + len(toks[1]) + 2 :][:4]
        out += [(q, {"stop": [first]}), (q, {"stop": [across]}),
                (q, {"stop": [across], "include_stop_str_in_output": True}),
                (q, {"stop": [later, "zzzz"], "logprobs": True, "top_logprobs": 2}),
                (q, {"stop": [first], "min_tokens": 3}), (q, {"stop": ["x" * 24 + "NEVER"], "max_tokens": 24}),
                (q, {"temperature": 0.9, "seed": 7, "stop": [later]})]
    return out


@pytest.fixture(scope="module")
def reference():
    """Colocated serving: the answers every other path must give."""
    cluster = start_cluster(MODEL, decode=1, engine_flags=ENGINE)
    try:
        todo = cases(cluster.base_url)
        return [(q, kw, chat(cluster.base_url, q, **kw), chat(cluster.base_url, q, stream=True, **kw))
                for q, kw in todo]
    finally:
        stop_cluster(cluster)


def _remote_prefills(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pdserve_router_prefill_decisions_total{outcome="remote"}'))


@pytest.mark.parametrize("decode_flags", [[], ["--speculative-config", '{"method": "ngram", '
                                                                        '"num_speculative_tokens": 4}']],
                         ids=["disaggregated", "disaggregated+ngram"])
def test_every_stop_case_equals_colocated(reference, decode_flags):
    cluster = start_cluster(MODEL, decode=1, prefill=1, engine_flags=ENGINE, router_flags=DISAGG,
                            decode_flags=decode_flags)
    try:
        for q, kw, whole, streamed in reference:
            assert chat(cluster.base_url, q, **kw) == whole, kw
            assert chat(cluster.base_url, q, stream=True, **kw) == streamed, kw
            assert streamed["text"] == whole["text"]
        assert _remote_prefills(cluster.base_url) >= 2 * len(reference)  # every request went through prefill
    finally:
        stop_cluster(cluster)


def _decode_busy(cluster) -> int | None:
    """Index (in cluster.workers) of a decode worker running a request that has produced some tokens."""
    for i, w in enumerate(cluster.workers):
        if w.role != "decode" or w.process.poll() is not None:
            continue
        import grpc

        from pdserve.proto.v1 import worker_pb2 as pb
        from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

        with grpc.insecure_channel(w.address) as ch:
            s = pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)
        if s.num_running > 0 and s.generation_tokens_total > 8:
            return i
    return None


def _migrated_answer(cluster, question: str, kw: dict, act) -> dict:
    """Stream ``question``; once a decode worker is producing it, ``act`` on that worker."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(chat(cluster.base_url, question, stream=True, **kw)))
    thread.start()
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and thread.is_alive() and time.monotonic() < deadline:
        victim = _decode_busy(cluster)
    assert victim is not None, "the request never ran on a decode worker"
    act(cluster.workers[victim].process)
    thread.join(180)
    assert not thread.is_alive() and result, "the request did not complete"
    return result


def test_migration_keeps_held_back_text_and_stop_strings():
    """A decode worker killed mid-stream: the next one sends the text the first held back (a long
    stop string that never completes keeps 28 characters held back at every step)."""
    q, kw = QUESTIONS[2], {"stop": ["x" * 24 + "NEVER"], "max_tokens": 160, "ignore_eos": True}
    colocated = start_cluster(MODEL, decode=1, engine_flags=ENGINE)
    try:
        expected = chat(colocated.base_url, q, stream=True, **kw)
    finally:
        stop_cluster(colocated)
    cluster = start_cluster(MODEL, decode=2, prefill=1, engine_flags=ENGINE, router_flags=DISAGG)
    try:
        got = _migrated_answer(cluster, q, kw, lambda p: p.send_signal(signal.SIGKILL))
        assert got == expected
        metrics = httpx.get(cluster.base_url + "/metrics").text
        assert "pdserve_router_migrations_total 1.0" in metrics
    finally:
        stop_cluster(cluster)


def test_a_hung_decode_worker_leaving_the_rotation_moves_its_streams():
    """A decode worker that stops answering (SIGSTOP) leaves the rotation at the next failed polls;
    its streams move to another worker then, not when TCP keepalive gives up."""
    from tests.integration.conftest import start_worker, stop_workers, wait_ready

    workers = [start_worker("decode", ["--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--num-threads", "1",
                                       "--no-load-progress", *ENGINE]) for _ in range(2)]
    log = tempfile.NamedTemporaryFile(prefix="router-", suffix=".log")
    router = None
    try:
        wait_ready(workers, timeout_s=300)
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.cli", "--log-level", "WARNING", "router",
                                   "--model", MODEL, "--port", str(port), "--poll-interval-s", "0.2",
                                   *sum((["--worker", w.address] for w in workers), [])], stderr=log)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, router)

        class Cluster:  # what _migrated_answer needs
            base_url = url

        Cluster.workers = workers
        stopped = []

        def hang(process):
            process.send_signal(signal.SIGSTOP)
            stopped.append(process)

        try:
            got = _migrated_answer(Cluster, QUESTIONS[2], {"max_tokens": 120, "ignore_eos": True}, hang)
        finally:
            for p in stopped:
                p.send_signal(signal.SIGKILL)
                p.wait()
        assert got["finish"] == "length" and got["tokens"] == 120
        assert "left the rotation" in Path(log.name).read_text()
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        stop_workers(workers, grace_s=10)
        log.close()


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "router exited"
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("router not ready")
