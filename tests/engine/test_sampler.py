"""The sampler on constructed logits: each parameter does what it says, seeds are private."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams

V = 8


def req(params: SamplingParams, prompt=(1, 2), output=()) -> Request:
    r = Request("r", list(prompt), params, eos_token_ids=(0,))
    for t in output:
        r.append_output_token(t)
    return r


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int = 2000, **kw) -> torch.Tensor:
    sampler = Sampler(seed=1)
    reqs = [req(params, **kw) for _ in range(n)]
    tokens, _ = sampler(logits.expand(n, -1).clone(), reqs)
    return torch.bincount(torch.tensor(tokens), minlength=V).float() / n


LOGITS = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.5, -1.0, 0.5, 1.5]])


def test_greedy_takes_argmax():
    tokens, _ = Sampler()(LOGITS.clone(), [req(SamplingParams(temperature=0))])
    assert tokens == [3]


def test_first_max_is_argmax_with_ties_nans_and_infinities():
    """Greedy tokens come from ``torch.max``'s indices (faster on CPUs): each row's first largest value,
    as ``torch.argmax`` picks it, ties, NaNs and infinities included, at the default model's width."""
    from pdserve.engine.sampler import first_max

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (64, 49152), generator=gen).float()  # many ties in every row
    x[5, 100] = x[5, 7] = float("nan")
    x[6, 9] = x[6, 90] = float("inf")
    x[7] = float("-inf")
    x[8, 33] = float("nan")
    x[8, 3] = float("inf")
    assert torch.equal(first_max(x), x.argmax(dim=-1))
    assert first_max(x)[5] == 7 and first_max(x)[6] == 9 and first_max(x)[7] == 0 and first_max(x)[8] == 33
    y = torch.randn(3, 1000, generator=gen).to(torch.bfloat16)
    assert torch.equal(first_max(y), y.argmax(dim=-1))


def test_temperature_sampling_matches_softmax():
    freq = draw_many(LOGITS, SamplingParams(temperature=1.0), n=20000)
    expected = torch.softmax(LOGITS[0], -1)
    assert (freq - expected).abs().max() < 0.015


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draw_many(LOGITS, SamplingParams(top_k=2)).nonzero().flatten().tolist()) == {3, 4}
    probs = torch.softmax(LOGITS[0], -1)  # sorted: 3 (.36), 4 (.22), 2 (.13), 7 (.08) ...
    support = set(draw_many(LOGITS, SamplingParams(top_p=0.6)).nonzero().flatten().tolist())
    assert support == {3, 4}, probs
    support = set(draw_many(LOGITS, SamplingParams(min_p=0.3)).nonzero().flatten().tolist())
    assert support == {2, 3, 4}  # p >= 0.3 * p_max


def test_penalties():
    sampler = Sampler()
    params = SamplingParams(temperature=0, repetition_penalty=100.0)
    tokens, _ = sampler(LOGITS.clone(), [req(params, prompt=(3,))])
    assert tokens == [4]  # 3 seen in the prompt: 3 / 100 < 2.5
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    tokens, _ = sampler(LOGITS.clone(), [req(params, prompt=(3,))])
    assert tokens == [3]  # presence counts output tokens only
    tokens, _ = sampler(LOGITS.clone(), [req(params, output=(3,))])
    assert tokens == [4]
    params = SamplingParams(temperature=0, frequency_penalty=0.3)
    tokens, _ = sampler(LOGITS.clone(), [req(params, output=(3, 3))])
    assert tokens == [4]  # 3 - 0.6 < 2.5


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[9.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    tokens, _ = Sampler()(logits.clone(), [req(params)])
    assert tokens == [1]
    tokens, _ = Sampler()(logits.clone(), [req(params, output=(1, 1))])
    assert tokens == [0]


def test_logprobs_are_raw_and_ranked():
    params = SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0)
    tokens, lps = Sampler()(LOGITS.clone(), [req(params, output=(3,))])
    raw = torch.log_softmax(LOGITS[0], -1)
    assert tokens == [4]
    assert math.isclose(lps[0].sampled.logprob, float(raw[4]), rel_tol=1e-6)
    assert lps[0].sampled.rank == 2
    assert [t.token_id for t in lps[0].top] == [3, 4, 2]


def test_seeded_rows_do_not_depend_on_batch_mates():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)

    def tokens_with(mates: int) -> list[int]:
        sampler = Sampler(seed=mates)
        r = req(params)
        others = [req(SamplingParams(temperature=1.0)) for _ in range(mates)]
        out = []
        for _ in range(5):
            t, _ = sampler(logits.expand(1 + mates, -1).clone(), [r, *others])
            out.append(t[0])
        return out

    assert tokens_with(0) == tokens_with(3) == tokens_with(7)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -1}),
        ("n", {"n": 0}),
        ("min_p", {"min_p": 2}),
        ("presence_penalty", {"presence_penalty": 3}),
        ("repetition_penalty", {"repetition_penalty": 0}),
        ("logprobs", {"logprobs": 21}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
        ("stop", {"stop": [""]}),
    ],
)
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)
