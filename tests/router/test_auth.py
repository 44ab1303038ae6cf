"""API keys and tenants (router/auth.py): where keys are read from and that only digests remain,
the bearer check, 401 in OpenAI's shape on every route but health and readiness, and the cache
salt each tenant's requests reach the workers with. A Router in this process over a scripted
decode worker that records what it was sent."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cluster.config import load_serve_config
from pdserve.configs import ConfigError
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.auth import OPEN, AuthConfig, Authenticator, Tenant, Unauthorized, key_digest
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run


def resolved(environ=None, **auth) -> AuthConfig:
    return load_serve_config(None, {"auth": auth}).auth.resolved(environ or {})


# ---- where keys come from ------------------------------------------------------------------------

def test_every_source_of_keys_ends_as_digests_only(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# tenant key\nacme  sk-from-file   # a comment\n\nbeta sha256:{key_digest('sk-beta')}\n")
    auth = resolved({"ACME_KEY": "sk-from-env", "PDSERVE_API_KEY": "sk-everyone"},
                    keys_file=str(keys), tenants={"acme": {"key_env": ["ACME_KEY"], "cache_group": "shared"}})
    assert auth.api_key == "" and auth.keys_file == "" and all(not t.key_env for t in auth.tenants.values())
    assert auth.tenants["acme"].key_sha256 == sorted([key_digest("sk-from-env"), key_digest("sk-from-file")])
    assert auth.tenants["beta"].key_sha256 == [key_digest("sk-beta")]
    assert auth.tenants["default"].key_sha256 == [key_digest("sk-everyone")]
    assert auth.tenants["acme"].cache_group == "shared"
    text = repr(auth)
    assert not any(k in text for k in ("sk-from-env", "sk-from-file", "sk-everyone"))
    assert auth.resolved({}) == auth  # resolving again (Ray's application builder does) changes nothing


def test_api_key_flag_makes_one_default_tenant():
    auth = resolved(api_key="sk-one")
    assert auth.enabled and list(auth.tenants) == ["default"]
    assert Authenticator(auth).tenant("Bearer sk-one") == Tenant("default", "default", frozenset({"default", "flex"}))


@pytest.mark.parametrize("auth, environ, message", [
    ({"tenants": {"acme": {"key_env": ["MISSING"]}}}, {}, "auth.tenants.acme.key_env: the environment variable "
                                                          "MISSING is not set"),
    ({"tenants": {"acme": {"key_sha256": ["abc"]}}}, {}, "auth.tenants.acme.key_sha256[0]: expected 64"),
    ({"tenants": {"bad name": {}}}, {}, "auth.tenants: 'bad name' is not a tenant name"),
    ({"tenants": {"a": {"key_env": ["K"]}, "b": {"key_env": ["K"]}}}, {"K": "same"},
     "one API key is listed for two tenants ('a' and 'b')"),
    ({"keys_file": "/nonexistent/keys"}, {}, "auth.keys_file: cannot read /nonexistent/keys"),
])
def test_a_key_that_cannot_be_used_is_refused_naming_where_it_came_from(auth, environ, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        resolved(environ, **auth)


@pytest.mark.parametrize("line", ["acme", "acme sk-1 extra", "ac/me sk-1", "acme sha256:xyz"])
def test_a_malformed_keys_file_line_is_refused_with_its_number(tmp_path, line):
    keys = tmp_path / "keys"
    keys.write_text(f"ok sk-fine\n{line}\n")
    with pytest.raises(ConfigError, match=f"auth.keys_file: {keys}, line 2"):
        resolved(keys_file=str(keys))


def test_an_unknown_tenant_key_is_refused_naming_the_tenant():
    with pytest.raises(ConfigError, match=r"config.auth.tenants.acme: unknown key\(s\) \['keys'\]"):
        load_serve_config(None, {"auth": {"tenants": {"acme": {"keys": ["x"]}}}})
    with pytest.raises(ConfigError, match="config.auth.tenants.acme: expected a mapping"):
        load_serve_config(None, {"auth": {"tenants": {"acme": "sk-1"}}})


def test_an_authenticator_takes_digests_only():
    with pytest.raises(ValueError, match="resolved"):
        Authenticator(AuthConfig(api_key="sk-plain"))


# ---- the bearer check ---------------------------------------------------------------------------

def test_without_keys_everything_is_open():
    auth = Authenticator(AuthConfig())
    assert not auth.enabled and not auth.needs_key("/v1/completions")
    assert auth.tenant(None) is OPEN and auth.tenant("Bearer anything") is OPEN
    assert OPEN.cache_salt("client") == "client" and OPEN.cache_salt(None) == ""  # as before keys existed


@pytest.mark.parametrize("header, says", [
    (None, "You didn't provide an API key"),
    ("", "You didn't provide an API key"),
    ("Basic c2stb25l", "You didn't provide an API key"),
    ("Bearer ", "You didn't provide an API key"),
    ("Bearer sk-wrong-but-long", "Incorrect API key provided: sk-****long."),
    ("Bearer short", "Incorrect API key provided: *****."),
])
def test_a_missing_or_wrong_key_is_unauthorized_without_echoing_it(header, says):
    auth = Authenticator(resolved(api_key="sk-right"))
    with pytest.raises(Unauthorized) as e:
        auth.tenant(header)
    assert str(e.value).startswith(says)
    assert "sk-wrong-but-long" not in str(e.value)


def test_the_scheme_is_case_insensitive_and_paths_say_whether_a_key_is_needed():
    auth = Authenticator(resolved(api_key="sk-right"))
    assert auth.tenant("bearer sk-right").name == "default"
    assert auth.tenant("  Bearer   sk-right ").name == "default"
    assert [auth.needs_key(p) for p in ("/health", "/ready", "/metrics", "/v1/models", "/tokenize")] == \
        [False, False, True, True, True]
    opened = Authenticator(dataclasses.replace(resolved(api_key="sk-right"), metrics_open=True))
    assert not opened.needs_key("/metrics")


def test_cache_salts_never_collide_across_tenants_and_groups_share():
    a, b = Tenant("a", "a"), Tenant("b", "b")
    assert a.cache_salt(None) != b.cache_salt(None)
    assert a.cache_salt("x") != a.cache_salt(None)
    assert a.cache_salt(None) == a.cache_salt("")  # no salt and "" are one partition, as the hash scheme says
    # the group's length is in the salt: ("ab", "c") and ("a", "bc") differ
    assert Tenant("t", "ab").cache_salt("c") != Tenant("t", "a").cache_salt("bc")
    assert Tenant("a", "shared").cache_salt("x") == Tenant("b", "shared").cache_salt("x")
    # a client cannot reach another tenant's partition by choosing its own salt
    assert a.cache_salt(b.cache_salt(None)) != b.cache_salt(None)
    assert OPEN.cache_salt(None) != a.cache_salt(None)


# ---- the router ---------------------------------------------------------------------------------

class _Recorder:
    """A decode worker answering one token, keeping each GenerateRequest it was sent."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request):
        self.requests.append(request)
        return ScriptedCall([pb.GenerateResponse(token_ids=[7], text="x", finished=True, finish_reason="length")])

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


@pytest.fixture
def keyed(make_client):
    """A router with tenants a and b (each its own cache), c sharing a's group, and one decode worker."""
    recorder = _Recorder()
    worker = in_rotation("decode")
    worker.stub = recorder
    auth = resolved({"A": "sk-a", "B": "sk-b", "C": "sk-c"}, tenants={
        "a": {"key_env": ["A"], "cache_group": "team"}, "b": {"key_env": ["B"]},
        "c": {"key_env": ["C"], "cache_group": "team"}})
    client = make_client([worker], auth=Authenticator(auth))
    return client, recorder


def _complete(client, key: str | None, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, **extra}
    return run(client.post("/v1/completions", json=body, headers=headers))


def test_routes_answer_401_in_openais_shape_without_a_key(keyed):
    client, recorder = keyed
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("GET", "/metrics")):
        r = run(client.request(method, path, json={"model": MODEL, "prompt": "hi"}))
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert _complete(client, "sk-nobody").status_code == 401
    assert recorder.requests == []  # nothing reached a worker
    assert run(client.get("/health")).status_code == 200
    assert run(client.get("/ready")).status_code == 200
    r = run(client.get("/v1/models", headers={"Authorization": "Bearer sk-b"}))
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_each_tenant_reaches_the_workers_with_its_own_cache_salt(keyed):
    client, recorder = keyed
    for key, salt in (("sk-a", None), ("sk-b", None), ("sk-c", None), ("sk-a", "mine"), ("sk-b", "mine")):
        r = _complete(client, key, **({"cache_salt": salt} if salt else {}))
        assert r.status_code == 200, r.text
    a, b, c, a_mine, b_mine = (r.cache_salt for r in recorder.requests)
    assert a != b and a == c  # c shares a's group
    assert len({a, b, a_mine, b_mine}) == 4  # a client's salt partitions within its tenant only
    assert "mine" in a_mine and all(s for s in (a, b))  # never the open partition ""


# ---- the command line ---------------------------------------------------------------------------

def test_config_show_prints_digests_and_config_digest_makes_one(capsys, monkeypatch):
    import io

    from pdserve.cluster.cli import main

    assert main(["config", "show", "--api-key", "sk-shown-nowhere"]) == 0
    out = capsys.readouterr().out
    assert "sk-shown-nowhere" not in out and key_digest("sk-shown-nowhere") in out
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-shown-nowhere\n"))
    assert main(["config", "digest"]) == 0
    assert capsys.readouterr().out.strip() == key_digest("sk-shown-nowhere")


def test_an_open_api_says_who_can_reach_it(caplog):
    import logging

    from pdserve.router.auth import warn_if_open

    with caplog.at_level(logging.INFO, logger="pdserve.router.auth"):
        warn_if_open(Authenticator(AuthConfig()), "127.0.0.1")
        warn_if_open(Authenticator(AuthConfig()), "0.0.0.0")
        warn_if_open(Authenticator(resolved(api_key="k")), "0.0.0.0")
    (local, anyone) = caplog.records
    assert local.levelno == logging.INFO and "this machine only" in local.getMessage()
    assert anyone.levelno == logging.WARNING and "anyone who can reach it" in anyone.getMessage()
