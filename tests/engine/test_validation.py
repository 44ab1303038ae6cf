"""Bad input to the engine raises a clear error that names the field."""

from __future__ import annotations

import pytest

from pdserve.configs import ConfigError
from pdserve.engine import EngineConfig, InvalidRequestError, SamplingParams


@pytest.fixture
def engine(make_engine):
    return make_engine(max_model_len=64)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        (list(range(100, 164)), SamplingParams(max_tokens=None), "prompt"),
        (list(range(100, 150)), SamplingParams(max_tokens=20), "max_tokens"),
        ([10**9], SamplingParams(), "prompt"),
        ([-1], SamplingParams(), "prompt"),
    ],
)
def test_bad_requests_name_the_field(engine, prompt, params, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", prompt, params)
    assert e.value.field == field and str(e.value).startswith(field)
    assert not engine.has_unfinished()


def test_context_errors_have_their_code(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", list(range(100, 170)))
    assert e.value.code == "context_length_exceeded" and "64" in str(e.value)


def test_duplicate_request_id(engine):
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("x", [1, 2, 3])
    engine.abort_request("x")


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"max_num_seqs": -1}, {"kv_cache_memory_gb": 0}])
def test_bad_engine_config(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        EngineConfig(**bad)
