"""A request continued by another engine (a prefill worker handing off after the first token, a
decode worker taking over from a lost one) outputs exactly what one engine would: the same
tokens, the same text with no gap or repeat, the same stop strings, finish reason and logprobs.

Each case runs the request on engine A with ``handoff_after=k`` (what a prefill worker does
with k=1; for k>1 it is what a decode worker lost after k tokens had sent), then on engine B
with every token so far and the characters of text the client has, as the router passes them.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model.tokenizer


PROMPT = "Once upon a time"
BASE = dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)


def _run(engine, rid, prompt, params, **kwargs):
    """Every delta of one request: (text chunks, tokens, logprob token ids, finish reason, stop reason)."""
    request = engine.make_request(rid, prompt, params, **kwargs)
    engine.add(request)
    texts, tokens, lps, finish = [], [], [], (None, None)
    while engine.has_unfinished():
        for out in engine.step():
            texts.append(out.new_text)
            tokens.extend(out.new_token_ids)
            lps.extend(lp.sampled.token_id for lp in out.new_logprobs or ())
            if out.finished:
                finish = (out.finish_reason, out.stop_reason)
    return texts, tokens, lps, finish


def one_engine(engine, prompt, params):
    texts, tokens, lps, finish = _run(engine, "one", prompt, params)
    return "".join(texts), tokens, lps, finish


def two_engines(a, b, prompt, params, k):
    """The request on ``a`` for k tokens, then on ``b`` after them."""
    texts, tokens, lps, finish = _run(a, "leg1", prompt, params, handoff_after=k)
    if finish[0] != "handoff":
        return "".join(texts), tokens, lps, finish
    sent = "".join(texts)
    more, rest, rest_lps, finish = _run(b, "leg2", prompt, params, output_token_ids=tokens,
                                        emitted_text_len=len(sent))
    return sent + "".join(more), tokens + rest, lps + rest_lps, finish


def _pieces(tokenizer, tokens):
    detok = tokenizer.detokenizer()
    out, text = [], ""
    for t in tokens:
        text += detok.step(t)
        out.append(text)
    return out


def _boundary_stops(tokenizer, full, tokens):
    """(k, stop) pairs: a stop string made of the last character before the k-th boundary and
    the first after it, occurring nowhere earlier in the text."""
    pieces = _pieces(tokenizer, tokens)
    cases = []
    for k in range(1, len(tokens) - 1):
        at = len(pieces[k - 1])
        if at == 0 or at >= len(full):
            continue
        stop = full[at - 1 : at + 1]
        if full.find(stop) == at - 1:
            cases.append((k, stop))
    return cases


def test_a_stop_string_across_the_handoff_is_found(make_engine, tokenizer):
    engine, a, b = make_engine(), make_engine(), make_engine()
    prompt = tokenizer.encode(PROMPT)
    full, tokens, _, _ = one_engine(engine, prompt, SamplingParams(**BASE))
    cases = _boundary_stops(tokenizer, full, tokens)
    assert len(cases) >= 3, "the reference text has too few usable boundaries"
    for k, stop in cases:
        for include in (False, True):
            params = SamplingParams(**BASE, stop=[stop], include_stop_str_in_output=include, logprobs=1)
            expected = one_engine(engine, prompt, params)
            assert expected[3] == ("stop", stop)
            assert two_engines(a, b, prompt, params, k) == expected, (k, stop, include)


def test_a_stop_string_in_the_first_token_ends_the_request_at_once(make_engine, tokenizer):
    engine, a, b = make_engine(), make_engine(), make_engine()
    prompt = tokenizer.encode(PROMPT)
    full, tokens, _, _ = one_engine(engine, prompt, SamplingParams(**BASE))
    first = _pieces(tokenizer, tokens)[0]
    assert first, "the first token's text is empty"
    params = SamplingParams(**BASE, stop=[first])
    expected = one_engine(engine, prompt, params)
    assert expected[1] == tokens[:1] and expected[3] == ("stop", first)
    assert two_engines(a, b, prompt, params, 1) == expected


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_and_stop_strings_across_the_handoff(make_engine, tokenizer, min_tokens):
    engine, a, b = make_engine(), make_engine(), make_engine()
    prompt = tokenizer.encode(PROMPT)
    full, tokens, _, _ = one_engine(engine, prompt, SamplingParams(**BASE))
    first = _pieces(tokenizer, tokens)[0]
    for stop in {first, full[2:5], full[6:8]}:
        params = SamplingParams(**BASE, stop=[stop], min_tokens=min_tokens)
        expected = one_engine(engine, prompt, params)
        for k in (1, 2, 4):
            assert two_engines(a, b, prompt, params, k) == expected, (stop, k)


def test_held_back_text_reaches_the_client_after_a_handoff_at_any_step(make_engine, tokenizer):
    """A long stop string that never completes keeps the last characters held back at every step;
    whoever continues sends them: the client's text has no gap at any split point."""
    engine, a, b = make_engine(), make_engine(), make_engine()
    prompt = tokenizer.encode("The weather today")
    full, tokens, _, _ = one_engine(engine, prompt, SamplingParams(**BASE))
    params = SamplingParams(**BASE, stop=["x" * 30 + "NEVER"])
    assert one_engine(engine, prompt, params)[0] == full
    for k in range(1, len(tokens)):
        text, got, _, finish = two_engines(a, b, prompt, params, k)
        assert (text, got, finish[0]) == (full, tokens, "length"), k


def test_greedy_continuation_with_logprobs(make_engine, tokenizer):
    engine, a, b = make_engine(), make_engine(), make_engine()
    prompt = tokenizer.encode("A list of colours:")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    expected = one_engine(engine, prompt, params)
    for k in (1, 5, 11):
        assert two_engines(a, b, prompt, params, k) == expected


def test_min_tokens_holds_eos_back_also_with_ignore_eos():
    """As vLLM: ignore_eos lets EOS be generated without stopping, but min_tokens still masks it."""
    logits = torch.tensor([[5.0, 1.0, 2.0]])  # EOS (0) is the most likely
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0, min_tokens=2, ignore_eos=ignore_eos)
        request = Request("r", [1, 2], params, eos_token_ids=(0,))
        tokens, _ = Sampler()(logits.clone(), [request])
        assert tokens == [2], ignore_eos


@pytest.mark.slow
def test_a_stop_string_inside_an_accepted_run_of_proposals_keeps_the_same_tokens(default_model):
    """Speculative decoding emits several tokens a step; the tokens after the one completing a
    stop string are dropped, so tokens, logprobs and counts equal one token per step. A seeded
    sampled request outputs exactly what it does without speculation."""
    import json

    from pdserve.engine import EngineConfig, LLMEngine
    from tests.conftest import assert_no_leaks

    def engine(spec=None):
        return LLMEngine(EngineConfig(load_progress=False, num_kv_blocks=64, speculative_config=spec),
                         loaded=default_model)

    plain, spec = engine(), engine(json.dumps({"method": "ngram", "num_speculative_tokens": 4}))
    prompt = default_model.tokenizer.encode_chat([{"role": "user", "content": "Repeat this sentence three times: "
                                                                              "I like green apples and red cherries."}])
    base = dict(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    full, tokens, _, _ = one_engine(plain, prompt, SamplingParams(**base))
    assert one_engine(spec, prompt, SamplingParams(**base))[:2] == (full, tokens)
    checked = 0
    for start in range(6, 37, 6):  # in the sentence the answer repeats: proposals are accepted there
        stop = full[start : start + 3]
        if full.find(stop) != start:
            continue
        params = SamplingParams(**base, stop=[stop])
        expected = one_engine(plain, prompt, params)
        before = spec.stats().spec_accepted
        assert one_engine(spec, prompt, params) == expected, stop
        checked += spec.stats().spec_accepted > before
    assert checked >= 2, "no stop string fell in an accepted run of proposals"
    seeded = SamplingParams(temperature=0.3, seed=3, max_tokens=30, ignore_eos=True, logprobs=1)
    before = spec.stats().spec_accepted
    assert one_engine(spec, prompt, seeded) == one_engine(plain, prompt, seeded)
    assert spec.stats().spec_accepted > before, "the seeded request accepted no proposal"
    assert_no_leaks(plain)
    assert_no_leaks(spec)


def test_a_continuation_with_max_tokens_already_reached_is_refused(make_engine):
    """Nothing is left to generate: sampling on would put a token past ``max_tokens`` (a router once
    continued a stream whose worker was lost after its last message: 17 tokens of 16)."""
    from pdserve.engine.sampling_params import InvalidRequestError

    engine = make_engine()
    params = SamplingParams(**BASE)
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("x", PROMPT, params, output_token_ids=list(range(100, 124)))
    assert e.value.field == "output_token_ids" and "already reach max_tokens (24)" in str(e.value)
    assert engine.make_request("y", PROMPT, params, output_token_ids=list(range(100, 123))).num_output_tokens == 23
