"""A router serving several models (router/models.py): a request reaches only the workers of the
model it names (by name or alias), each model tokenizes with its own tokenizer, an unknown model
gets a 404 naming the served ones, /v1/models lists them with their aliases, and /ready waits for
every model. A Router in this process over scripted workers (no model behind them)."""

from __future__ import annotations

import httpx
import pytest

from pdserve.configs import ConfigError
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.app import Router, RouterConfig
from pdserve.router.models import ModelWorkers, ServedModel
from pdserve.router.pool import WorkerHandle, WorkerPool
from tests.router.conftest import MODEL, ScriptedCall, run

GEMMA = "gemma-3-270m"


class _Worker:
    """Answers every request with one token, and keeps the prompts it was sent."""

    def __init__(self, token: int):
        self.token, self.prompts = token, []

    def Generate(self, request):
        self.prompts.append(list(request.prompt_token_ids))
        return ScriptedCall([pb.GenerateResponse(token_ids=[self.token], finished=True, finish_reason="length")])

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


def _worker(model: str, port: int, token: int, healthy: bool = True) -> WorkerHandle:
    info = pb.WorkerInfo(worker_id=f"decode-{model}", role="decode", model=model, max_model_len=4096 + port)
    w = WorkerHandle(f"127.0.0.1:{port}", info=info, healthy=healthy)
    w.stub = _Worker(token)
    return w


@pytest.fixture(scope="module")
def tokenizers(tokenizer):
    return {MODEL: tokenizer, GEMMA: load_tokenizer(GEMMA)}


def _client(tokenizers, workers: list[WorkerHandle], **config) -> httpx.AsyncClient:
    pool = WorkerPool([])
    pool.workers = workers
    models = [ServedModel(MODEL, tokenizers[MODEL], MODEL, ("smollm2", "small")),
              ServedModel(GEMMA, tokenizers[GEMMA], GEMMA)]
    router = Router(RouterConfig(**config), pool, models)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=router.create_app()), base_url="http://router")


def _call(client, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def go():
        async with client:
            return await (client.get(path) if method == "GET" else client.post(path, json=body))
    return run(go())


def test_each_request_reaches_only_its_models_workers_tokenized_by_its_tokenizer(tokenizers):
    small, gemma = _worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)
    for name, worker, other in ((MODEL, small, gemma), ("smollm2", small, gemma), (GEMMA, gemma, small)):
        spec = MODEL if worker is small else GEMMA
        before = len(other.stub.prompts)
        r = _call(_client(tokenizers, [small, gemma]), "POST", "/v1/completions",
                  {"model": name, "prompt": "Hello there", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == spec  # the model's name, for an alias too
        assert worker.stub.prompts[-1] == tokenizers[spec].encode("Hello there")
        assert len(other.stub.prompts) == before  # nothing crossed to the other model's workers
    # the two tokenizers differ on this text: each model's own was used
    assert tokenizers[MODEL].encode("Hello there") != tokenizers[GEMMA].encode("Hello there")


def test_latency_and_token_metrics_carry_the_model(tokenizers):
    client = _client(tokenizers, [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)])

    async def go():
        async with client:
            for name in ("smollm2", GEMMA):
                await client.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
            return (await client.get("/metrics")).text
    text = run(go())
    for model in (MODEL, GEMMA):  # an alias counts under its model's name
        assert f'pdserve_router_generation_tokens_total{{model="{model}"}} 1.0' in text
        assert f'pdserve_router_time_to_first_token_seconds_count{{model="{model}"}} 1.0' in text


def test_an_unknown_model_gets_a_404_naming_the_served_ones(tokenizers):
    r = _call(_client(tokenizers, [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)]), "POST", "/v1/completions",
              {"model": "llama-3-8b", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for name in (MODEL, "smollm2", "small", GEMMA):
        assert repr(name) in error["message"], error


def test_tokenize_without_a_model_is_refused_naming_the_served_ones(tokenizers):
    """(Generation requests must name a model anyway, as in OpenAI's API; /tokenize may omit it.)"""
    r = _call(_client(tokenizers, [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)]), "POST", "/tokenize",
              {"prompt": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert repr(GEMMA) in r.json()["error"]["message"]


def test_v1_models_lists_every_model_and_alias_with_its_context_length(tokenizers):
    r = _call(_client(tokenizers, [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)]), "GET", "/v1/models")
    cards = {c["id"]: c for c in r.json()["data"]}
    assert list(cards) == [MODEL, "smollm2", "small", GEMMA]
    assert cards["smollm2"]["parent"] == MODEL and cards[MODEL]["parent"] is None
    assert (cards[MODEL]["max_model_len"], cards[GEMMA]["max_model_len"]) == (4097, 4098)  # each its workers'
    assert cards[GEMMA]["root"] == GEMMA


def test_tokenize_uses_the_named_models_tokenizer(tokenizers):
    workers = [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)]
    for name in (MODEL, GEMMA):
        r = _call(_client(tokenizers, workers), "POST", "/tokenize", {"model": name, "prompt": "Hello there"})
        assert r.json()["tokens"] == tokenizers[name].encode("Hello there")


def test_ready_waits_for_every_model(tokenizers):
    client = _client(tokenizers, [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22, healthy=False)])
    r = _call(client, "GET", "/ready")
    assert r.status_code == 503 and r.json()["reason"].startswith(f"{GEMMA}: no decode worker"), r.json()
    r = _call(_client(tokenizers, [_worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)]), "GET", "/ready")
    assert r.status_code == 200, r.json()


def test_a_model_without_workers_answers_503_while_the_other_serves(tokenizers):
    client = _client(tokenizers, [_worker(MODEL, 1, 11)], startup_wait_s=0.0)
    r = _call(client, "POST", "/v1/completions", {"model": GEMMA, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 503, r.text
    r = _call(_client(tokenizers, [_worker(MODEL, 1, 11)]), "POST", "/v1/completions",
              {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_model_workers_keep_only_their_models():
    pool = WorkerPool([])
    a, b = _worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)
    pool.workers = [a, b]
    assert ModelWorkers(pool, GEMMA).healthy("decode") == [b]
    assert ModelWorkers(pool, "").healthy("decode") == [a, b]  # a one-model router keeps every worker
    assert ModelWorkers(pool, GEMMA).model_info().model == GEMMA


def test_several_models_must_each_be_named(tokenizers):
    with pytest.raises(ConfigError, match="each is named"):
        Router(RouterConfig(), WorkerPool([]), [ServedModel(MODEL, tokenizers[MODEL]),
                                                ServedModel(GEMMA, tokenizers[GEMMA], GEMMA)])


def test_a_worker_that_left_the_pool_leaves_the_per_worker_gauges(tokenizers):
    """/metrics shows the last snapshot of each worker in rotation; a worker out of rotation or gone
    from the pool shows none (its last snapshot, say one request running, would otherwise stay)."""
    small, gemma = _worker(MODEL, 1, 11), _worker(GEMMA, 2, 22)
    small.snapshot = pb.LoadSnapshot(num_running=1, num_waiting=2)
    pool = WorkerPool([])
    pool.workers = [small, gemma]
    router = Router(RouterConfig(), pool, [ServedModel(MODEL, tokenizers[MODEL], MODEL),
                                           ServedModel(GEMMA, tokenizers[GEMMA], GEMMA)])

    def scrape() -> str:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                return (await c.get("/metrics")).text
        return run(go())

    app = router.create_app()
    assert f'pdserve_worker_num_running{{worker="{small.worker_id}"}} 1.0' in scrape()
    small.healthy = False  # out of rotation: no longer polled
    assert f'worker="{small.worker_id}"' not in scrape()
    small.healthy = True
    assert f'pdserve_worker_num_running{{worker="{small.worker_id}"}} 1.0' in scrape()
    pool.workers = [gemma]  # gone from the pool
    text = scrape()
    assert f'worker="{small.worker_id}"' not in text
    assert f'pdserve_worker_num_running{{worker="{gemma.worker_id}"}} 0.0' in text
