"""The prefix-cache timing side channel between tenants (CVE-2025-46570), measured: tenant A sends
prompts; tenant B times the same prompts (each probe a prompt A just ran) and fresh ones of the same
length, interleaved. B's probes of A's prompts are never prefix hits and their TTFT has the
distribution of B's misses, while A's own repeats are hits, and fast enough that B would see the
difference if the cache were shared. SmolLM2-135M's shape with random weights, one decode worker."""

from __future__ import annotations

import random
import statistics
import time

import httpx
import pytest

from tests.integration.conftest import start_cluster, stop_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "random:smollm2-135m"
PROBES = 50
PROMPT_TOKENS = 160  # 10 full blocks: a miss computes them all, a hit only the last


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text("a sk-tenant-a\nb sk-tenant-b\n")
    c = start_cluster(MODEL, decode=1, engine_flags=["--num-kv-blocks", "2048"],
                      router_flags=["--api-keys-file", str(keys)])
    yield c
    stop_cluster(c)


def ttft(client: httpx.Client, key: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens the worker found cached."""
    start = time.perf_counter()
    first = None
    cached = None
    with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": MODEL, "prompt": [prompt], "max_tokens": 2, "temperature": 0, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None and '"text"' in line:
                first = time.perf_counter() - start
            if '"usage"' in line and '"prompt_tokens_details"' in line:
                cached = httpx.Response(200, content=line[6:]).json()["usage"]["prompt_tokens_details"][
                    "cached_tokens"]
    return first, cached


def test_another_tenants_prompt_times_like_a_miss_and_ones_own_repeat_is_a_hit(cluster):
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]

    probe, miss, own_repeat = [], [], []
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        ttft(client, "sk-tenant-b", fresh())  # warm-up
        for _ in range(PROBES):
            secret = fresh()
            ttft(client, "sk-tenant-a", secret)
            own_repeat.append(ttft(client, "sk-tenant-a", secret))
            probe.append(ttft(client, "sk-tenant-b", secret))  # B times the prompt A just ran
            miss.append(ttft(client, "sk-tenant-b", fresh()))  # and one nobody ran
    assert all(cached == 0 for _, cached in probe), "B's probe hit A's cache"
    assert all(cached >= PROMPT_TOKENS - 16 for _, cached in own_repeat), "A's repeat missed its own cache"
    med = {name: statistics.median(t for t, _ in values) for name, values in
           (("probe", probe), ("miss", miss), ("own_repeat", own_repeat))}
    # The channel is there to be seen: A's hit is clearly faster than a miss...
    assert med["own_repeat"] < 0.7 * med["miss"], med
    # ...and B's probes of A's prompts take as long as its misses (medians within 20%; a hit would be
    # the 30% or more above).
    assert 0.8 < med["probe"] / med["miss"] < 1.25, med
    print("TTFT medians (s):", {k: round(v, 4) for k, v in med.items()})
