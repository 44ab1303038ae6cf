"""`pdserve cascade calibrate`'s table (pdserve/cluster/cascade_cli.py), on stage runs whose answer is
known, and the shipped prompt set; the command itself on a tiny random model pair."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.cascade_cli import (
    DEFAULT_PROMPTS,
    StageRun,
    candidate_thresholds,
    read_prompts,
    suggest,
    table,
)
from tests.cluster.test_cli import pdserve

# Four prompts: the cheap stage is sure of the first two (and right), unsure of the last two (one right).
CHEAP = StageRun("cheap", [[1], [2], [3], [4]], [[-0.1], [-0.2], [-2.0], [-3.0]], seconds=1.0, tokens=[10] * 4)
DEAR = StageRun("dear", [[1], [2], [9], [4]], [[-0.1]] * 4, seconds=4.0, tokens=[10] * 4)


def test_each_threshold_row_counts_share_agreement_and_compute():
    rows = {r.threshold: r for r in table(CHEAP, DEAR, [-5.0, -1.0, 0.0])}
    everything = rows[-5.0]  # all four answered cheaply: the third differs from the reference
    assert (everything.answered_cheap, everything.agreement, everything.cheap_agree) == (1.0, 0.75, 0.75)
    assert everything.compute_saved == pytest.approx(1 - 1.0 / 4.0)
    sure = rows[-1.0]  # the two sure ones: both agree; the rest escalate (and agree by construction)
    assert (sure.answered_cheap, sure.agreement, sure.cheap_agree) == (0.5, 1.0, 1.0)
    assert sure.compute_saved == pytest.approx(1 - (1.0 + 2.0) / 4.0)
    none = rows[0.0]
    assert (none.answered_cheap, none.agreement, none.cheap_agree) == (0.0, 1.0, None)
    assert none.compute_saved == pytest.approx(-0.25)  # the cheap stage ran for nothing


def test_agreement_on_the_first_tokens_only():
    cheap = StageRun("cheap", [[1, 2, 3], [1, 5]], [[-0.1] * 3, [-0.1] * 2], 1.0, [5, 5])
    dear = StageRun("dear", [[1, 2, 4], [2, 5]], [[-0.1] * 3, [-0.1] * 2], 1.0, [5, 5])
    assert table(cheap, dear, [-1.0])[0].agreement == 0.0
    assert table(cheap, dear, [-1.0], agree_tokens=2)[0].agreement == 0.5


def test_the_suggestion_answers_most_cheaply_at_the_target():
    rows = table(CHEAP, DEAR, [-5.0, -1.0, 0.0])
    assert suggest(rows, 0.9).threshold == -1.0
    assert suggest(rows, 0.7).threshold == -5.0
    assert candidate_thresholds(CHEAP)[0] == -3.0 and candidate_thresholds(CHEAP)[-1] == 0.0
    empty = StageRun("e", [[]], [[]], 1.0, [1])
    assert candidate_thresholds(empty) == [0.0]
    assert table(empty, empty, [-1e9])[0].answered_cheap == 0.0  # an empty answer is never confident


def test_the_shipped_prompt_set_has_over_a_hundred_distinct_chats():
    prompts = read_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 100
    texts = [p["messages"][0]["content"] for p in prompts]
    assert len(set(texts)) == len(texts)


def test_a_bad_prompt_file_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match="p.jsonl, line 2: expected an object with 'prompt' or 'messages'"):
        read_prompts(path)


@pytest.mark.slow
def test_calibrate_runs_end_to_end_on_random_models(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("engine: {num_kv_blocks: 64, load_progress: false}\n"
                      "models: {a: {engine: {model: 'random:tiny', quantization: int8}}, b: {engine: {model: "
                      "'random:tiny'}}}\n"
                      "cascades: {auto: {stages: [a, b], accept_mean_logprob: -1.0}}\n")
    out = tmp_path / "table.json"
    result = pdserve("cascade", "calibrate", "--config", str(config), "--cascade", "auto", "--limit", "8",
                     "--max-tokens", "4", "--batch", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "answered cheap" in result.stdout and "flags:" in result.stdout
    data = json.loads(out.read_text())
    assert data["prompts"] == 8 and data["rows"] and data["stages"] == ["a", "b"] and data["batch"] == 3
    missing = pdserve("cascade", "calibrate", "--config", str(config), "--cascade", "nope")
    assert missing.returncode == 2 and "'nope' is not in" in missing.stderr
