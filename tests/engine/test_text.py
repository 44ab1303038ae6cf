"""Text out of the engine: incremental detokenisation, stop strings, chat templates."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from tests.conftest import run_to_completion


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model.tokenizer


def test_incremental_detokenisation_never_emits_broken_utf8(tokenizer):
    text = "Grüße 🙂 from 東京 — naïve café ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer()
    chunks = [detok.step(t) for t in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    assert any(c == "" for c in chunks), "expected a character split across tokens"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # control tokens are matched whole
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_from_gguf(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHello<|im_end|>\n"
                                                                     "<|im_start|>assistant\n")


def _seeded_text(engine, prompt, **kw):
    """Seeded sampling: reproducible, and varied even from a random-weight model."""
    engine.add_request("g", prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True, **kw))
    texts, tokens = [], []
    finish = None
    while engine.has_unfinished():
        for out in engine.step():
            texts.append(out.new_text)
            tokens.extend(out.new_token_ids)
            if out.finished:
                finish = (out.finish_reason, out.stop_reason)
    return texts, tokens, finish


def test_stop_string_across_token_boundaries_is_excluded(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("Once upon a time")
    texts, tokens, _ = _seeded_text(engine, prompt)
    full = "".join(texts)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    cut = next(i for i in range(3, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    start = len(pieces[cut - 1]) - 1
    stop = full[start : len(pieces[cut]) + 2]
    assert stop and full.find(stop) == start
    texts, tokens, finish = _seeded_text(engine, prompt, stop=[stop])
    assert "".join(texts) == full[:start]
    assert finish == ("stop", stop)
    texts, _, _ = _seeded_text(engine, prompt, stop=[stop], include_stop_str_in_output=True)
    assert "".join(texts) == full[: start + len(stop)]


def test_streamed_deltas_hold_back_a_forming_stop_string(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("The weather today")
    texts, _, _ = _seeded_text(engine, prompt)
    full = "".join(texts)
    stop = full[-6:] + "NEVER"  # matches a prefix of the tail only: never completes
    streamed, _, finish = _seeded_text(engine, prompt, stop=[stop])
    assert "".join(streamed) == full and finish[0] == "length"
    emitted = 0
    for chunk in streamed[:-1]:
        emitted += len(chunk)
        assert emitted <= len(full) - (len(stop) - 1) or chunk == ""


def test_stop_token_ids_and_eos(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("Hello there")
    _, tokens, _ = _seeded_text(engine, prompt)
    target = tokens[4]
    _, got, finish = _seeded_text(engine, prompt, stop_token_ids=[target])
    assert got == tokens[: tokens.index(target) + 1] and finish == ("stop", target)
    engine.add_request("m", prompt, SamplingParams(temperature=0, max_tokens=5))
    out = run_to_completion(engine)["m"]
    assert len(out) <= 5
