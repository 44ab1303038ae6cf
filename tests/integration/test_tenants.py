"""API keys and tenants over real processes: a router with a keys file in front of a decode worker.
The official openai SDK gets in with a key and is refused (401) without a right one; a prompt one
tenant ran is a prefix-cache hit for that tenant and for a tenant sharing its cache group, never
for another tenant (the cache salt is the server's, derived from the key)."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest

from tests.integration.conftest import start_cluster, stop_cluster

pytestmark = pytest.mark.integration
MODEL = "random:tiny"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text("a sk-tenant-a\nb sk-tenant-b\n")
    config = keys.parent / "cluster.yaml"
    config.write_text("auth:\n  tenants:\n    a: {cache_group: team}\n    c: {cache_group: team}\n"
                      "    b: {}\n")
    # c's key comes as a digest, as a file kept in git would hold it
    with keys.open("a") as f:
        f.write(f"c sha256:{hashlib.sha256(b'sk-tenant-c').hexdigest()}\n")
    cluster = start_cluster(MODEL, decode=1, engine_flags=["--num-kv-blocks", "128"],
                            router_flags=["--config", str(config), "--api-keys-file", str(keys)])
    yield cluster
    stop_cluster(cluster)


def sdk(cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=key, max_retries=0)


def test_the_sdk_gets_in_with_a_key_and_is_refused_without_a_right_one(keyed):
    with sdk(keyed, "sk-tenant-a") as client:
        out = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8]], max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        assert [m.id for m in client.models.list().data] == [MODEL]
    with sdk(keyed, "sk-wrong-key-here") as client, pytest.raises(openai.AuthenticationError) as e:
        client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8]], max_tokens=3)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "sk-wrong-key-here" not in str(e.value)
    assert httpx.get(keyed.base_url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(keyed.base_url + "/health", timeout=10).status_code == 200


def test_a_tenants_prompt_is_a_hit_for_itself_and_its_group_never_for_another(keyed):
    prompt = list(range(1000, 1080))  # 5 full blocks of 16

    def cached(key: str) -> int:
        with sdk(keyed, key) as client:
            out = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=1, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("sk-tenant-a") == 0
    assert cached("sk-tenant-a") >= 64  # its own repeat: a hit
    assert cached("sk-tenant-b") == 0  # another tenant: computed again
    assert cached("sk-tenant-c") >= 64  # the same cache group as a
    assert cached("sk-tenant-b") >= 64  # and b's own repeat
