"""``usage.prompt_tokens_details.cached_tokens``: the prefix hit of the worker that computed each
prompt, as that worker reported it; each prompt counted once, as ``prompt_tokens`` counts it.
A Router in this process over workers answering from a script (no model behind them)."""

from __future__ import annotations

import orjson
import pytest

from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.responses import cached_prompt_tokens
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run


def _tokens(cached: int, *ids: int, finished: bool = False) -> pb.GenerateResponse:
    return pb.GenerateResponse(token_ids=list(ids), text="x" * len(ids), num_cached_tokens=cached,
                               finished=finished, finish_reason="length" if finished else "")


class _Decode:
    """Generate: 2 tokens, every message reporting ``cached`` (its hit, as the engine sends it on each)."""

    def __init__(self, cached: int, reserve_cached: int = 0):
        self.cached, self.reserve_cached = cached, reserve_cached

    def Generate(self, request):
        hit = self.cached if not request.kv_handle else self.reserve_cached
        return ScriptedCall([_tokens(hit, 7), _tokens(hit, 8, finished=True)])

    async def Reserve(self, request, timeout=None):
        return pb.ReserveResponse(handle=request.request_id, cached_tokens=self.reserve_cached)

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


class _Prefill:
    def __init__(self, cached: int):
        self.cached = cached

    def Prefill(self, request):
        return ScriptedCall([pb.PrefillResponse(first=_tokens(self.cached, 6))])


def _worker(role: str, stub):
    w = in_rotation(role)
    w.stub = stub
    return w


def _completion(client, prompt, stream: bool = False, n: int = 1):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "n": n, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return run(client.post("/v1/completions", json=body))


def _streamed_usage(response) -> dict:
    chunks = [orjson.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return chunks[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_remote_prefill_reports_the_prefill_workers_hit_not_the_decode_workers(make_client, stream):
    """The prefill worker computed the prompt (its hit: 32); the decode worker's reservation found
    128 there, which saved shipping those blocks, not computing them. (The old router took the
    largest hit any message carried: 128.)"""
    client = make_client([_worker("prefill", _Prefill(cached=32)), _worker("decode", _Decode(0, 128))])
    r = _completion(client, list(range(100, 400)), stream)
    assert r.status_code == 200, r.text
    use = _streamed_usage(r) if stream else r.json()["usage"]
    assert use["prompt_tokens"] == 300
    assert use["prompt_tokens_details"] == {"cached_tokens": 32}


def test_colocated_reports_the_decode_workers_hit_and_each_prompt_counts_once(make_client):
    client = make_client([_worker("decode", _Decode(48))])
    one = _completion(client, list(range(100, 200)))
    assert one.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    # two prompts: both hits, as prompt_tokens counts both (the old router reported the largest: 48)
    two = _completion(client, [list(range(100, 200)), list(range(300, 400))])
    assert two.json()["usage"]["prompt_tokens"] == 200
    assert two.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    # chat, streamed with its final usage
    chat = run(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}))
    assert _streamed_usage(chat)["prompt_tokens_details"] == {"cached_tokens": 48}


@pytest.mark.parametrize("per_choice, n, cached", [
    ([None], 1, 0),  # a choice that produced nothing
    ([16], 1, 16),
    ([16, 32], 1, 48),  # two prompts
    ([0, 32], 2, 32),  # one prompt, two samples: the later sample hit the first's blocks
    ([0, 32, 16, 16], 2, 48),
])
def test_cached_prompt_tokens(per_choice, n, cached):
    assert cached_prompt_tokens(per_choice, n) == cached
