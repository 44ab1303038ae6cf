"""The official openai SDK against a live pdserve (two decode workers, the default model)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pdserve.engine import EngineConfig, LLMEngine
from tests.conftest import assert_text_matches_greedy

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(served):
    c = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offline(default_model):
    return LLMEngine(EngineConfig(num_kv_blocks=256, load_progress=False), loaded=default_model)


def test_models_lists_the_default(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_stream_equals_non_stream_equals_offline_greedy(client, offline):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "Paris" in text
    prompt = offline.tokenizer.encode_chat(QUESTION)
    assert full.usage.prompt_tokens == len(prompt)
    assert_text_matches_greedy(offline, prompt, text, 40, "chat")


def test_completions_stream_equals_non_stream_equals_offline(client, offline):
    prompt = "The three primary colours are"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stream=True))
    assert streamed == full.choices[0].text
    assert full.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    assert_text_matches_greedy(offline, offline.tokenizer.encode(prompt), full.choices[0].text, 24, "completion")
    echoed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, echo=True)
    assert echoed.choices[0].text == prompt + full.choices[0].text


def test_n2_and_seeded_sampling_reproducible(client):
    kw = dict(model=MODEL, messages=QUESTION, temperature=1.0, max_tokens=20, n=2, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == sum(
        len(c.logprobs.content) if c.logprobs else 0 for c in a.choices) or a.usage.completion_tokens > 0
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == [c.message.content for c in a.choices]


def test_stop_strings(client):
    base = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    text = base.choices[0].message.content
    stop = text[10:16]
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_consistent_with_tokens(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12,
                                         logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    raw = b"".join(bytes(t.bytes) for t in content).decode()
    assert raw.startswith(choice.message.content)  # the final <|im_end|> adds bytes, not text
    for t in content:
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.logprob == pytest.approx(values[0], abs=1e-5)  # greedy picks the top token
    comp = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=6, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert "".join(lp.tokens) == comp.choices[0].text


def test_32_concurrent_streams_match_their_solo_runs(served, offline):
    questions = [f"Give me one fact about the number {i}." for i in range(32)]

    async def ask(client, q: str, stream: bool) -> str:
        messages = [{"role": "user", "content": q}]
        if not stream:
            r = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
            return r.choices[0].message.content
        text = ""
        async for chunk in await client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                                 max_tokens=24, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0) as client:
            together = await asyncio.gather(*(ask(client, q, True) for q in questions))
            alone = [await ask(client, q, False) for q in questions[:8]]
        return together, alone

    together, alone = asyncio.run(main())
    assert together[:8] == alone
    for q, text in zip(questions, together):
        prompt = offline.tokenizer.encode_chat([{"role": "user", "content": q}])
        assert_text_matches_greedy(offline, prompt, text, 24, q)
    assert all(s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks for s in served.stats())


def test_echo_with_logprobs_gives_the_prompt_logprobs(client, offline):
    """echo + logprobs: the prompt's tokens come first with their logprobs (the first has none),
    equal to the engine's own prompt logprobs, then the completion's."""
    from pdserve.engine import SamplingParams

    prompt = "The three primary colours are"
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    ids = offline.tokenizer.encode(prompt)
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offline.add_request("echo", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    reference = None
    while offline.has_unfinished():
        for o in offline.step():
            reference = o.prompt_logprobs or reference
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - reference[i].sampled.logprob) < 1e-3, i
        assert len(lp.top_logprobs[i]) == 2
    assert all(x is not None for x in lp.token_logprobs[len(ids):])
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)]) and lp.text_offset[0] == 0
