"""Request bodies: fields pdserve cannot honour are refused with a 400 naming them."""

from __future__ import annotations

import orjson
import pytest

from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, parse_body

HI = [{"role": "user", "content": "hi"}]


def parse(model, **fields):
    return parse_body(model, orjson.dumps({"model": "m", **fields}))


@pytest.mark.parametrize("tier", ["scale", "gold"])
@pytest.mark.parametrize("model,fields", [(ChatCompletionRequest, {"messages": HI}),
                                          (CompletionRequest, {"prompt": "hi"})])
def test_a_service_tier_that_is_not_served_is_refused(model, fields, tier):
    with pytest.raises(OpenAIError) as e:
        parse(model, service_tier=tier, **fields)
    assert e.value.status == 400 and e.value.param == "service_tier" and "service_tier" in e.value.message


@pytest.mark.parametrize("tier", [None, "auto", "default", "flex", "priority"])
def test_the_served_service_tiers_are_accepted(tier):
    assert parse(ChatCompletionRequest, messages=HI, service_tier=tier).service_tier == tier


@pytest.mark.parametrize("field, value", [("top_k", 2**40), ("min_tokens", 2**40), ("seed", 2**70),
                                          ("priority", 2**40), ("stop_token_ids", [2**40]), ("max_tokens", 2**40),
                                          ("prompt", [2**40]), ("prompt", [[1, -1]])])
def test_numbers_the_wire_cannot_carry_are_400_naming_the_field(field, value):
    """int32 counts and token ids, int64 seeds: found by the fuzzing test as 500s (building the worker
    request failed), now refused when the body is parsed."""
    import json

    with pytest.raises(OpenAIError) as e:  # json, not orjson: a client may send any integer
        parse_body(CompletionRequest, json.dumps({"model": "m", "prompt": [1, 2], field: value}).encode())
    assert e.value.status == 400 and e.value.param == field
