"""Cascades (router/cascade.py): a request to the virtual model runs on the cheap stage; its answer is
accepted when its tokens' log-probabilities clear the thresholds, else the request runs again on the
next stage. Thresholds that force each path, JSON and streaming; the response names the model that
answered and usage counts and lists every stage. A Router in this process over scripted workers."""

from __future__ import annotations

import math

import httpx
import orjson
import pytest

from pdserve.configs import ConfigError
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.app import Router, RouterConfig
from pdserve.router.cascade import CascadeConfig, Score, accepts
from pdserve.router.models import ServedModel
from pdserve.router.pool import WorkerHandle, WorkerPool
from tests.router.conftest import MODEL, ScriptedCall, run

CHEAP, DEAR = "smollm2-int4", "smollm2"


class _Worker:
    """Answers with fixed tokens, each with a fixed log-probability; keeps the requests it was sent."""

    def __init__(self, tokens: list[int], logprob: float):
        self.tokens, self.logprob, self.requests = tokens, logprob, []

    def Generate(self, request):
        self.requests.append(request)
        want = request.sampling.HasField("logprobs")
        messages = []
        for i, t in enumerate(self.tokens):
            lps = [pb.PositionLogprobs(sampled=pb.TokenLogprob(token_id=t, logprob=self.logprob, rank=1))] if want \
                else []
            messages.append(pb.GenerateResponse(token_ids=[t], text=f"<{t}>", logprobs=lps,
                                                finished=i == len(self.tokens) - 1, finish_reason="length"))
        return ScriptedCall(messages)

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


def _worker(model: str, port: int, tokens: list[int], logprob: float) -> WorkerHandle:
    info = pb.WorkerInfo(worker_id=f"decode-{model}", role="decode", model=model, max_model_len=4096)
    w = WorkerHandle(f"127.0.0.1:{port}", info=info, healthy=True)
    w.stub = _Worker(tokens, logprob)
    return w


@pytest.fixture
def cluster(tokenizer):
    """(client factory, cheap worker, dear worker): cheap answers 3 tokens at logprob -0.5 each."""
    cheap, dear = _worker(CHEAP, 1, [5, 6, 7], -0.5), _worker(DEAR, 2, [8, 9], -0.1)

    def client(**thresholds) -> httpx.AsyncClient:
        pool = WorkerPool([])
        pool.workers = [cheap, dear]
        models = [ServedModel(MODEL, tokenizer, CHEAP), ServedModel(MODEL, tokenizer, DEAR)]
        cascades = {"auto": CascadeConfig([CHEAP, DEAR], **thresholds)}
        router = Router(RouterConfig(), pool, models, cascades=cascades)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=router.create_app()), base_url="http://router")

    return client, cheap.stub, dear.stub


def _post(client, body: dict) -> httpx.Response:
    async def go():
        async with client:
            return await client.post("/v1/completions", json=body)
    return run(go())


def _stream(client, body: dict) -> list[dict]:
    async def go():
        async with client:
            r = await client.post("/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            return [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    return run(go())


BODY = {"model": "auto", "prompt": "Hello", "max_tokens": 3}


def test_a_confident_cheap_answer_is_accepted_and_the_dear_stage_never_runs(cluster):
    client, cheap, dear = cluster
    r = _post(client(accept_mean_logprob=-1.0), BODY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == CHEAP and body["choices"][0]["text"] == "<5><6><7>"
    assert body["choices"][0]["logprobs"] is None  # scored with them, shown only when asked for
    (stage,) = body["usage"]["stages"]
    assert stage == {"model": CHEAP, "mean_logprob": -0.5, "min_logprob": -0.5, "accepted": True,
                     "prompt_tokens": body["usage"]["prompt_tokens"], "completion_tokens": 3}
    assert len(cheap.requests) == 1 and not dear.requests
    assert cheap.requests[0].sampling.HasField("logprobs")  # the scorer's input


def test_an_unsure_cheap_answer_escalates_and_usage_counts_both_stages(cluster):
    client, cheap, dear = cluster
    r = _post(client(accept_mean_logprob=-0.4), BODY)  # -0.5 < -0.4: escalate
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == DEAR and body["choices"][0]["text"] == "<8><9>"
    first, second = body["usage"]["stages"]
    assert (first["model"], first["accepted"], first["completion_tokens"]) == (CHEAP, False, 3)
    assert (second["model"], second["accepted"], second["completion_tokens"]) == (DEAR, True, 2)
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == first["prompt_tokens"] + second["prompt_tokens"]
    assert list(dear.requests[0].prompt_token_ids) == list(cheap.requests[0].prompt_token_ids)
    assert not dear.requests[0].sampling.HasField("logprobs")  # the last stage is not scored


def test_the_min_threshold_alone_decides_too(cluster):
    client, _, _ = cluster
    assert _post(client(accept_min_logprob=-0.6), BODY).json()["model"] == CHEAP
    assert _post(client(accept_min_logprob=-0.49), BODY).json()["model"] == DEAR


@pytest.mark.parametrize(("threshold", "model", "text"), [(-1.0, CHEAP, "<5><6><7>"), (-0.1, DEAR, "<8><9>")])
def test_streaming_sends_the_accepted_answer_named_with_every_stage_in_usage(cluster, threshold, model, text):
    client, _, _ = cluster
    chunks = _stream(client(accept_mean_logprob=threshold), BODY)
    assert {c["model"] for c in chunks} == {model}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    stages = chunks[-1]["usage"]["stages"]
    assert [s["model"] for s in stages] == ([CHEAP] if model == CHEAP else [CHEAP, DEAR])


def test_a_stage_without_workers_is_passed_over(tokenizer):
    dear = _worker(DEAR, 2, [8, 9], -0.1)
    pool = WorkerPool([])
    pool.workers = [dear]  # the cheap pool has no worker at all
    models = [ServedModel(MODEL, tokenizer, CHEAP), ServedModel(MODEL, tokenizer, DEAR)]
    router = Router(RouterConfig(startup_wait_s=0.0), pool, models,
                    cascades={"auto": CascadeConfig([CHEAP, DEAR], accept_mean_logprob=-5.0)})
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=router.create_app()), base_url="http://router")
    body = _post(client, BODY).json()
    assert body["model"] == DEAR
    first, second = body["usage"]["stages"]
    assert (first["model"], first["accepted"], first["error"]) == (CHEAP, False, "no_worker_available")
    assert body["usage"]["completion_tokens"] == 2


def test_logprobs_asked_for_come_with_an_accepted_cheap_answer(cluster):
    client, _, _ = cluster
    body = _post(client(accept_mean_logprob=-1.0), {**BODY, "logprobs": 0}).json()
    assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([-0.5] * 3)


def test_the_cascade_is_listed_and_an_unknown_name_lists_it(cluster):
    client, _, _ = cluster

    async def go():
        async with client(accept_mean_logprob=-1.0) as c:
            return (await c.get("/v1/models")).json(), (await c.post("/v1/completions", json={**BODY,
                                                                                            "model": "x"}))
    models, missing = run(go())
    (card,) = [c for c in models["data"] if c["id"] == "auto"]
    assert card["stages"] == [CHEAP, DEAR]
    assert missing.status_code == 404 and "'auto'" in missing.text


def test_scores_and_acceptance():
    assert Score.of([-1.0, -3.0]) == Score(-2.0, -3.0, 2)
    assert Score.of([]).mean == -math.inf  # an empty answer is not confident
    config = CascadeConfig(["a", "b"], accept_mean_logprob=-2.0, accept_min_logprob=-3.0)
    assert accepts(config, [Score(-2.0, -3.0, 2)])
    assert not accepts(config, [Score(-2.0, -3.0, 2), Score(-1.0, -3.5, 2)])  # every choice must pass


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stages": ["a"], "accept_mean_logprob": -1.0}, "at least two"),
    ({"stages": ["a", "a"], "accept_mean_logprob": -1.0}, "named twice"),
    ({"stages": ["a", "b"]}, "set at least one"),
    ({"stages": ["a", "b"], "accept_min_logprob": 0.5}, "at most 0"),
])
def test_bad_cascades_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CascadeConfig(**kwargs)


def test_a_cascade_must_name_served_models(tokenizer):
    models = [ServedModel(MODEL, tokenizer, CHEAP), ServedModel(MODEL, tokenizer, DEAR)]
    with pytest.raises(ConfigError, match="'gpt-4' is not a served model"):
        Router(RouterConfig(), WorkerPool([]), models,
               cascades={"auto": CascadeConfig([CHEAP, "gpt-4"], accept_mean_logprob=-1.0)})
    with pytest.raises(ConfigError, match="the name is a served model's"):
        Router(RouterConfig(), WorkerPool([]), models,
               cascades={CHEAP: CascadeConfig([CHEAP, DEAR], accept_mean_logprob=-1.0)})
