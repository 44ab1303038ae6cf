"""Benchmark workloads: what each request asks for. Reproducible from a seed.

| name | requests |
|---|---|
| `random` | random token-id prompts, input and output lengths uniform in their ranges |
| `prefix` | N shared prefixes of P tokens, each request one of them plus S random tokens (prefix caching) |
| `chat` | multi-turn conversations: turn k's prompt holds turns 1..k-1 and the model's real answers |
| `jsonl` | a file, one JSON object per line: `{"prompt": ...}` or `{"messages": [...]}`, optional `"output_len"` |
| `conversational` | input and output lengths drawn from data/conversational.csv (see data/README.md) |

Token-id prompts have exact token counts (sent to /v1/completions as ids; decoded to text for
the chat endpoint). The chat workload's turns are generated while the run goes, from answers.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent / "data"
WORKLOADS = ("random", "prefix", "chat", "jsonl", "conversational")

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but be have which "
    "one you were all we when there can an their said she if will each about how up out them then so some "
    "would make like him into time has look two more write go see number no way could people my than first "
    "water been call who its now find long down day did get come made may part over new sound take only "
    "little work know place year live me back give most very after thing our just name good sentence man "
    "think say great where help through much before line right too mean old any same tell boy follow came "
    "want show also around form three small set put end does another well large must big even such because "
    "turn here why ask went men read need land different home us move try kind hand picture again change off "
    "play spell air away animal house point page letter mother answer found study still learn should world"
).split()


@dataclass
class WorkItem:
    """One request (or, for `chat`, one conversation whose turns become requests)."""

    prompt: str | list[int] | None = None  # for /v1/completions
    messages: list[dict] | None = None  # for /v1/chat/completions
    input_len: int = 0  # tokens, when known up front
    output_len: int | None = None  # max_tokens (None: the server's default)
    turns: list[str] = field(default_factory=list)  # `chat`: the user's messages, one per turn


def _sample_ids(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, vocab: tuple[int, int],
                    seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        i, o = _lengths(rng, input_len, range_ratio), _lengths(rng, output_len, range_ratio)
        items.append(WorkItem(prompt=_sample_ids(rng, i, *vocab), input_len=i, output_len=o))
    return items


def prefix_workload(n: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                    vocab: tuple[int, int], seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    prefixes = [_sample_ids(rng, prefix_len, *vocab) for _ in range(num_prefixes)]
    items = []
    for k in range(n):
        ids = prefixes[k % num_prefixes] + _sample_ids(rng, suffix_len, *vocab)
        items.append(WorkItem(prompt=ids, input_len=len(ids), output_len=output_len))
    rng.shuffle(items)
    return items


def chat_workload(conversations: int, turns: int, user_words: int, output_len: int, seed: int) -> list[WorkItem]:
    rng = random.Random(seed)

    def utterance() -> str:
        n = max(1, int(rng.gauss(user_words, user_words / 4)))
        return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "?"

    return [WorkItem(turns=[utterance() for _ in range(turns)], output_len=output_len) for _ in range(conversations)]


def prompt_objects(path: str | Path, flag: str) -> list[tuple[int, dict]]:
    """(line number, object) of a JSONL prompt file: each line an object with ``prompt`` (text) or
    ``messages`` (a chat); errors name ``flag``, the file and the line."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path}, line {lineno}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
            raise ValueError(f"{flag} {path}, line {lineno}: expected an object with 'prompt' or 'messages'")
        out.append((lineno, obj))
    return out


def jsonl_workload(path: str, n: int | None, seed: int) -> list[WorkItem]:
    items = []
    for lineno, obj in prompt_objects(path, "--dataset-path"):
        out = obj.get("output_len")
        if out is not None and (not isinstance(out, int) or out < 1):
            raise ValueError(f"--dataset-path {path}, line {lineno}: output_len must be a positive integer")
        items.append(WorkItem(prompt=obj.get("prompt"), messages=obj.get("messages"), output_len=out))
    if not items:
        raise ValueError(f"--dataset-path {path}: no requests in the file")
    if n is not None and n > len(items):  # repeat the file to reach n, in a seeded order
        rng = random.Random(seed)
        items = items + [rng.choice(items) for _ in range(n - len(items))]
    return items[:n] if n is not None else items


def conversational_lengths() -> list[tuple[int, int]]:
    with open(DATA / "conversational.csv") as f:
        return [(int(r["input_tokens"]), int(r["output_tokens"])) for r in csv.DictReader(f)]


def conversational_workload(n: int, vocab: tuple[int, int], seed: int, max_len: int | None = None) -> list[WorkItem]:
    rng = random.Random(seed)
    pairs = conversational_lengths()
    items = []
    for _ in range(n):
        i, o = rng.choice(pairs)
        if max_len is not None and i + o > max_len:
            i = max(1, min(i, max_len - o))
        items.append(WorkItem(prompt=_sample_ids(rng, i, *vocab), input_len=i, output_len=o))
    return items
