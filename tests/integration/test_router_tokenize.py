"""``/tokenize`` and ``/detokenize`` on a live router count tokens as the serving endpoints do."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_counts_what_the_completions_count(served):
    url = served.base_url
    chat = post(url, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 1})
    tok = post(url, "/tokenize", {"model": MODEL, "messages": QUESTION})
    assert tok["count"] == len(tok["tokens"]) == chat["usage"]["prompt_tokens"]
    max_model_len = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    assert tok["max_model_len"] == max_model_len

    prompt = "The capital of France is"
    done = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert post(url, "/tokenize", {"model": MODEL, "prompt": prompt})["count"] == done["usage"]["prompt_tokens"]


def test_the_calls_vllm_bench_makes(served):
    # vllm bench serve re-aligns its prompts with these two calls when its tokenizer disagrees.
    text = "a prompt of some length, to be cut to a number of tokens"
    tokens = post(served.base_url, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})["tokens"]
    cut = post(served.base_url, "/detokenize", {"model": MODEL, "tokens": tokens[:5]})["prompt"]
    assert text.startswith(cut) and post(served.base_url, "/tokenize", {"model": MODEL, "prompt": cut})["count"] == 5
