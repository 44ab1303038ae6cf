"""Workloads are reproducible from their seed and have the lengths asked for."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.runner import arrival_offsets
from pdserve.bench.workloads import (
    chat_workload,
    conversational_lengths,
    conversational_workload,
    jsonl_workload,
    prefix_workload,
    random_workload,
)

VOCAB = (100, 49000)


def test_random_lengths_and_seed():
    a = random_workload(50, 100, 20, 0.5, VOCAB, seed=3)
    b = random_workload(50, 100, 20, 0.5, VOCAB, seed=3)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert all(50 <= len(x.prompt) == x.input_len <= 150 and 10 <= x.output_len <= 30 for x in a)
    assert random_workload(5, 100, 20, 0.0, VOCAB, seed=4)[0].prompt != a[0].prompt
    assert all(len(x.prompt) == 64 for x in random_workload(5, 64, 8, 0.0, VOCAB, seed=1))


def test_prefix_requests_share_prefixes():
    items = prefix_workload(20, num_prefixes=3, prefix_len=40, suffix_len=5, output_len=8, vocab=VOCAB, seed=0)
    prefixes = {tuple(x.prompt[:40]) for x in items}
    assert len(prefixes) == 3 and all(len(x.prompt) == 45 for x in items)


def test_chat_conversations():
    convs = chat_workload(3, turns=4, user_words=10, output_len=16, seed=0)
    assert len(convs) == 3 and all(len(c.turns) == 4 for c in convs)
    assert convs[0].turns == chat_workload(3, 4, 10, 16, seed=0)[0].turns


def test_jsonl(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello", "output_len": 5}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    items = jsonl_workload(str(f), None, 0)
    assert items[0].prompt == "hello" and items[0].output_len == 5 and items[1].messages
    assert len(jsonl_workload(str(f), 7, 0)) == 7
    f.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match="line 1: output_len"):
        jsonl_workload(str(f), None, 0)
    f.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1: not JSON"):
        jsonl_workload(str(f), None, 0)


def test_conversational_distribution_is_shipped():
    pairs = conversational_lengths()
    assert len(pairs) >= 50 and all(i > 0 and o > 0 for i, o in pairs)
    items = conversational_workload(30, VOCAB, seed=0)
    assert {(x.input_len, x.output_len) for x in items} <= set(pairs)


@pytest.mark.parametrize("kind", ["poisson", "gamma", "constant"])
def test_arrivals_have_the_rate(kind):
    offsets = arrival_offsets(4000, 20.0, kind, 0.5 if kind == "gamma" else 1.0, seed=0)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / len(offsets) == pytest.approx(1 / 20.0, rel=0.08)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    cv = (sum((g - 0.05) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.05
    expected = {"poisson": 1.0, "gamma": 2 ** 0.5, "constant": 0.0}[kind]  # std/mean of the gaps
    assert cv == pytest.approx(expected, abs=0.12)
    assert arrival_offsets(3, float("inf"), kind, 1.0, 0) == [0.0, 0.0, 0.0]


def test_dataset_file_roundtrip(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(3)))
    assert [x.prompt for x in jsonl_workload(str(path), None, 0)] == ["p0", "p1", "p2"]
