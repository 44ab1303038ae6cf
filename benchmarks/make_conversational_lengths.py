"""Regenerate pdserve/bench/data/conversational.csv (the `conversational` workload's lengths).

    python benchmarks/make_conversational_lengths.py

Each row is one chat request of the shipped conversations (data/conversations.jsonl: short
questions, instructions with context, long pasted documents, multi-turn chats): its prompt
length in tokens (with the chat template) and the length of the default model's greedy answer
(up to 1024 tokens, ending at EOS). The shape is therefore measured, not assumed: it is how
long SmolLM2-135M-Instruct's answers are to this mix of conversations.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from pdserve.engine import LLM, SamplingParams

DATA = Path(__file__).resolve().parents[1] / "pdserve" / "bench" / "data"


def main() -> None:
    llm = LLM(kv_cache_memory_gb=2.0)
    conversations = [json.loads(line) for line in (DATA / "conversations.jsonl").read_text().splitlines() if line]
    requests = []
    for conv in conversations:
        turns = conv["turns"]
        history: list[dict] = []
        for i, turn in enumerate(turns):
            history = history + [{"role": "user", "content": turn}]
            requests.append(list(history))
            history.append({"role": "assistant", "content": conv.get("answers", [""] * len(turns))[i]})
    prompts = [llm.tokenizer.encode_chat(r) for r in requests]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1024))
    with open(DATA / "conversational.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["input_tokens", "output_tokens"])
        for p, o in zip(prompts, outs):
            w.writerow([len(p), len(o.outputs[0].token_ids)])
    print(f"wrote {len(prompts)} rows to {DATA / 'conversational.csv'}")


if __name__ == "__main__":
    main()
