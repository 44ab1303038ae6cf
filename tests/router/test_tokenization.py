"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, with errors in OpenAI's."""

from __future__ import annotations

import pytest

from tests.router.conftest import MODEL, in_rotation, run

HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(make_client):
    return make_client([in_rotation("decode", max_model_len=8192)])


def post(client, path: str, body: dict):
    return run(client.post(path, json=body))


def test_tokenize_a_prompt(client, tokenizer):
    r = post(client, "/tokenize", {"model": MODEL, "prompt": "Hello, world!"})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("Hello, world!")
    assert r.json() == {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}
    with_strs = post(client, "/tokenize", {"prompt": "Hello, world!", "return_token_strs": True}).json()
    assert with_strs["token_strs"] == [tokenizer.id_to_token(i) for i in ids]  # model is optional


def test_tokenize_messages_as_the_chat_endpoint_does(client, tokenizer):
    r = post(client, "/tokenize", {"model": MODEL, "messages": HI})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode_chat(HI, add_generation_prompt=True)
    bare = post(client, "/tokenize", {"model": MODEL, "messages": HI, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.encode_chat(HI, add_generation_prompt=False)
    assert bare["count"] < r.json()["count"]


def test_detokenize_gives_the_text_back(client):
    text = "The capital of France is Paris. <|im_end|>"
    ids = post(client, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = post(client, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}  # special tokens kept, as vLLM does


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/tokenize", {"model": MODEL, "messages": HI, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model"),
])
def test_errors_name_the_field(client, path, body, status, param):
    r = post(client, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_max_model_len_is_null_until_a_worker_reports_it(make_client):
    r = post(make_client([]), "/tokenize", {"prompt": "hi"})
    assert r.status_code == 200 and r.json()["max_model_len"] is None


def test_a_model_without_a_chat_template_answers_chat_with_a_400_saying_so():
    """Gemma 3 270M is a base model: its GGUF has no chat template. Chat requests and chat
    tokenization get a 400 naming `messages` and the reason; nothing reaches a worker."""
    import httpx

    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.router.app import Router, RouterConfig
    from pdserve.router.models import ServedModel
    from pdserve.router.pool import WorkerPool

    pool = WorkerPool([])
    pool.workers = [in_rotation("decode")]
    gemma = "gemma-3-270m"
    router = Router(RouterConfig(served_model_name=gemma), pool, [ServedModel(gemma, load_tokenizer(gemma))])
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=router.create_app()), base_url="http://router")
    for path, body in (("/v1/chat/completions", {"model": "gemma-3-270m", "messages": HI, "max_tokens": 4}),
                       ("/tokenize", {"model": "gemma-3-270m", "messages": HI})):
        r = post(client, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"], error
    assert post(client, "/tokenize", {"model": "gemma-3-270m", "prompt": "Hi"}).json()["tokens"] == [2, 10979]
