"""Request bodies: the limit from the context length, refused before reading, parsed off the loop."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.asgi import MIN_BODY_LIMIT, body_limit, read_body
from pdserve.router.protocol import OpenAIError
from tests.router.conftest import MODEL, in_rotation, run


def test_the_limit_follows_the_context_length_with_a_floor():
    assert body_limit(2048) == MIN_BODY_LIMIT == 1 << 20  # 2048 x 128 + 64 KiB is under the floor
    assert body_limit(8192) == 8192 * 128 + (64 << 10)  # 1.06 MiB: the default model
    assert body_limit(131072) == 131072 * 128 + (64 << 10)
    assert body_limit(None) == body_limit(131072)  # no worker has reported its context yet
    assert body_limit(8192, configured=5000) == 5000


def test_no_prompt_that_fits_the_context_is_refused(tokenizer):
    # The rule's bound (128 bytes a token as JSON) holds for every token of the vocabulary, so a
    # body holding max_model_len tokens of any text (plus the rest of the request) fits.
    import json

    longest = max(len(json.dumps(tokenizer.token_bytes(i).decode("utf-8", "replace")))
                  for i in range(tokenizer.vocab_size))
    assert longest - 2 <= 128


def _receiver(chunks: list[bytes]):
    sent = []

    async def receive():
        chunk = chunks[len(sent)]
        sent.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": len(sent) < len(chunks)}

    return receive, sent


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    receive, sent = _receiver([b"x" * 10])
    scope = {"headers": [(b"content-length", b"50000000")]}
    with pytest.raises(OpenAIError) as e:
        asyncio.run(read_body(scope, receive, limit=1000))
    assert e.value.status == 413 and e.value.code == "request_too_large" and "50000000" in e.value.message
    assert sent == []  # nothing was read


def test_an_undeclared_body_is_cut_off_at_the_limit():
    receive, sent = _receiver([b"x" * 400] * 100)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(read_body({"headers": []}, receive, limit=1000))
    assert e.value.status == 413
    assert len(sent) == 3  # stopped at the chunk that crossed the limit
    receive, _ = _receiver([b"x" * 400, b"y" * 400])
    assert asyncio.run(read_body({"headers": []}, receive, limit=1000)) == b"x" * 400 + b"y" * 400


def test_over_the_limit_is_413_in_openai_shape(make_client):
    client = make_client([in_rotation("decode")])
    r = run(client.post("/v1/chat/completions", content=b" " * (body_limit(8192) + 1),
                          headers={"content-type": "application/json"}))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and set(r.json()["error"]) == {
        "message", "type", "param", "code"}


def test_a_completion_batch_past_max_batch_is_400(make_client):
    client = make_client([in_rotation("decode")], max_batch=4)
    r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 2}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_large_body_is_tokenised_while_the_loop_serves(make_client):
    # A prompt over the context (about 600k tokens in 1 MB) is tokenised on a thread: /health
    # answers meanwhile, and the answer is the context error.
    import random
    import string

    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(50000)]
    text = " ".join(rng.choices(words, k=200000))[:1_000_000]
    client = make_client([in_rotation("decode")])

    async def main() -> tuple[int, dict]:
        big = asyncio.create_task(client.post("/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": text}]}))
        answered_meanwhile = 0
        while not big.done():
            r = await asyncio.wait_for(client.get("/health"), 2.0)
            assert r.status_code == 200
            answered_meanwhile += not big.done()
        return answered_meanwhile, big.result().json()

    answered_meanwhile, answer = run(main())
    assert answer["error"]["code"] == "context_length_exceeded"
    assert answered_meanwhile > 0
