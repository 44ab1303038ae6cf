"""Where a prompt is prefilled: every outcome of the one pure decision, as a table."""

from __future__ import annotations

import pytest

from pdserve.router.policy import DisaggregationConfig, PrefillInputs, prefill_route

CFG = DisaggregationConfig(min_prompt_tokens=128, min_uncached_tokens=64)


@pytest.mark.parametrize("inputs, outcome", [
    (PrefillInputs(1000, prefill_available=False), "local_no_prefill_worker"),
    (PrefillInputs(1000, prefill_available=False, reserved=True), "local_no_prefill_worker"),
    (PrefillInputs(1000, prefill_available=True, prompt_logprobs=True), "local_prompt_logprobs"),
    (PrefillInputs(127, prefill_available=True), "local_short"),
    (PrefillInputs(127, prefill_available=True, reserved=True), "local_short"),
    (PrefillInputs(128, prefill_available=True), "reserve"),
    (PrefillInputs(128, prefill_available=True, reserved=False), "local_no_room"),
    (PrefillInputs(200, prefill_available=True, reserved=True, cached_tokens=137), "local_cached"),
    (PrefillInputs(200, prefill_available=True, reserved=True, cached_tokens=136), "remote"),
    (PrefillInputs(200, prefill_available=True, reserved=True, cached_tokens=0), "remote"),
    # With both ways in predicted seconds (router/cost.py): the cheaper one; a tie stays remote
    (PrefillInputs(200, True, reserved=True, local_s=0.3, remote_s=0.5), "local_faster"),
    (PrefillInputs(200, True, reserved=True, local_s=0.5, remote_s=0.3), "remote"),
    (PrefillInputs(200, True, reserved=True, local_s=0.5, remote_s=0.5), "remote"),
    (PrefillInputs(200, True, reserved=True, local_s=0.3), "remote"),  # no prefill cost: not compared
    # The rules before the costs keep their meaning whatever the costs say
    (PrefillInputs(127, True, reserved=True, local_s=9.0, remote_s=0.1), "local_short"),
    (PrefillInputs(200, True, reserved=True, cached_tokens=137, local_s=9.0, remote_s=0.1), "local_cached"),
    (PrefillInputs(200, True, reserved=False, local_s=9.0, remote_s=0.1), "local_no_room"),
    (PrefillInputs(200, False, reserved=True, local_s=9.0, remote_s=0.1), "local_no_prefill_worker"),
])
def test_prefill_route_outcomes(inputs, outcome):
    assert prefill_route(inputs, CFG) == outcome
