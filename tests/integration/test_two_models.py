"""Two models behind one `pdserve serve` (issue: several models in one cluster): SmolLM2-135M-Instruct
and Gemma 3 270M, each with its own pools, over real processes. Each model answers its own requests
token-identically to its offline engine, on both launchers; with the processes launcher each prompt
is prefilled on its model's prefill worker and decoded on its model's decode worker (a KV transfer to
the other model's decode worker would be refused by the fingerprint check and counted as a fault:
there are none). Two cascades over them, whose thresholds force acceptance and escalation, answer
with the right model's exact text. An unknown model gets a 404 naming both; /v1/models lists both
with their aliases."""

from __future__ import annotations

import signal

import httpx
import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.integration.test_serve_cli import start_serve, stop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMOL, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
MAX_TOKENS = 12


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def references():
    """Each model's greedy answer to each prompt, from its offline engine (the same token ids)."""
    out = {}
    for model in (SMOL, GEMMA):
        llm = LLM(model, load_progress=False, kv_cache_memory_gb=0.25)
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        results = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        out[model] = [(i, r.outputs[0].text) for i, r in zip(ids, results)]
        del llm
    return out


@pytest.mark.parametrize("launcher", ["processes", "ray"])
def test_two_models_each_answer_exactly_on_their_own_pools(references, tmp_path, launcher):
    """processes: disaggregated, every prompt prefilled remotely (each request's KV crosses between two
    workers, of its model). ray: colocated, one DecodeWorker-NAME replica per model."""
    config = tmp_path / "two.yaml"
    # Two cascades over them whose thresholds force each path: "always" takes SmolLM2's answer, "never"
    # (every token certain, mean log-probability 0) escalates every request to Gemma.
    config.write_text("models:\n"
                      f"  {SMOL}: {{aliases: [smollm2]}}\n"
                      f"  {GEMMA}: {{aliases: [gemma]}}\n"
                      "cascades:\n"
                      f"  always: {{stages: [{SMOL}, {GEMMA}], accept_mean_logprob: -1000.0}}\n"
                      f"  never: {{stages: [{SMOL}, {GEMMA}], accept_mean_logprob: 0.0}}\n")
    remote = launcher == "processes"
    proc, url = start_serve("--config", str(config), "--prefill", "1" if remote else "0", "--decode", "1",
                            "--disagg-min-prompt-tokens", "0", "--disagg-min-uncached-tokens", "0",
                            # four one-thread workers contend on two cores, and would prefill locally
                            *(["--no-cost-contention"] if remote else []),
                            launcher=launcher, models=(), timeout=600)
    try:
        cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [c["id"] for c in cards] == [SMOL, "smollm2", GEMMA, "gemma", "always", "never"]
        for model, name in ((SMOL, SMOL), (GEMMA, "gemma")):
            for ids, want in references[model]:
                r = httpx.post(url + "/v1/completions", json={
                    "model": name, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
                    timeout=120)
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["model"] == model and body["usage"]["completion_tokens"] == MAX_TOKENS
                assert body["choices"][0]["text"] == want, (model, ids)
        for cascade, model, stages in (("always", SMOL, [SMOL]), ("never", GEMMA, [SMOL, GEMMA])):
            ids, want = references[model][0]
            r = httpx.post(url + "/v1/completions", json={
                "model": cascade, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
                timeout=120)
            body = r.json()
            assert (body["model"], body["choices"][0]["text"]) == (model, want), body
            assert [s["model"] for s in body["usage"]["stages"]] == stages
        r = httpx.post(url + "/v1/completions", json={"model": "llama", "prompt": "Hi", "max_tokens": 1}, timeout=10)
        assert r.status_code == 404 and SMOL in r.text and GEMMA in r.text, r.text
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, "pdserve_router_prefill_decisions_total", outcome="remote") == \
            ((2 * len(PROMPTS) + 3) if remote else 0)  # 3: the cascades' stages
        assert _metric(metrics, "pdserve_router_faults_total") == 0, metrics
    finally:
        assert stop(proc, signal.SIGTERM, "pid") < 60
    assert proc.returncode == 0
