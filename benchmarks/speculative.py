"""Speculative decoding: decode speed with and without it, same run, same engine.

    python benchmarks/speculative.py                      # about 5 minutes on 2 cores
    python benchmarks/speculative.py --max-tokens 64 --no-draft

Workloads (SmolLM2-135M-Instruct, greedy, chat template):
- input-grounded: edit a given text (fix one word, return the whole text), and complete a
  given Python file (the answer repeats most of its input: n-gram lookup finds it);
- open-ended chat: questions whose answers are not in the prompt.
Each runs as a single request and as a batch of 8 (the workload's prompts, repeated), with
plain decoding, `ngram` (k = --k) and `draft` (the same model cut to --draft-layers layers).

Decode speed: output tokens after the first / (time of the last token - time of the first),
summed over the batch's requests over the batch's decode span. Greedy outputs are compared with
plain decoding token by token. Prints a table with speed-ups, writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and every "
    "morning he climbed them again to put it out. Ships passed far below, their crews never knowing "
    "his name, but they knew the light, and the light was enough. In winter the wind threw salt "
    "against the glass until it turned grey, and he would polish it by hand, slowly, one pane after "
    "another, while the sea roared beneath him like an animal that could not reach its prey."
)
CODE = '''def parse_size(text: str) -> int:
    """Parse a size such as '10k', '3M' or '512' into a number of bytes."""
    units = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(size: int) -> str:
    """Format a number of bytes as a short human-readable string."""
    for unit in ("", "k", "M", "G"):
        if size < 1024:
            return f"{size:.0f}{unit}"
        size /= 1024
    return f"{size:.0f}T"
'''

WORKLOADS = {
    "edit a text": [
        "Fix the spelling of 'lighthouse' if needed and return the whole text unchanged otherwise:\n\n" + TEXT,
        "Return this text exactly, with 'keeper' replaced by 'watchman':\n\n" + TEXT,
    ],
    "complete code": [
        "Here is a Python file. Rewrite it exactly, adding a docstring line to the module:\n\n" + CODE,
        "Copy this Python code exactly:\n\n" + CODE,
    ],
    "open-ended chat": [
        "Write a short story about a robot who learns to paint.",
        "What are three good habits for staying healthy? Explain each.",
    ],
}


def run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    span = max(last.values()) - min(first.values())
    decoded = sum(len(t) - 1 for t in tokens.values())
    stats = engine.stats()
    return {"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "decode_tok_s": decoded / span if span else 0.0,
            "decoded": decoded, "proposed": stats.spec_proposed, "accepted": stats.spec_accepted,
            "steps": stats.spec_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens per request (default: %(default)s)")
    p.add_argument("--k", type=int, default=6, help="tokens proposed per step (default: %(default)s)")
    p.add_argument("--draft-layers", type=int, default=8,
                   help="layers kept in the draft model, cut from the target; 0 keeps them all (the target as its "
                        "own draft: every proposal should be accepted) (default: %(default)s)")
    p.add_argument("--no-draft", action="store_true", help="skip the draft-model method")
    p.add_argument("--batch", type=int, default=8, help="the batched run's request count (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: %(default)s)")
    args = p.parse_args()

    import torch
    from tqdm import tqdm

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(progress=True)
    methods = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k}}
    if not args.no_draft:
        methods["draft"] = {"method": "draft", "model": "smollm2-135m-instruct", "num_speculative_tokens": args.k}
        if args.draft_layers:
            methods["draft"]["draft_num_layers"] = args.draft_layers
    engines = {name: LLMEngine(EngineConfig(load_progress=False, speculative_config=spec, num_threads=args.threads),
                               loaded=loaded) for name, spec in methods.items()}
    tok = loaded.tokenizer
    rows = []
    runs = [(w, b, m) for w in WORKLOADS for b in (1, args.batch) for m in methods]
    bar = tqdm(runs, desc="speculative", unit="run", file=sys.stderr)
    results: dict = {}
    for workload, batch, method in bar:
        bar.set_postfix_str(f"{workload}, batch {batch}, {method}")
        prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in WORKLOADS[workload]]
        prompts = prompts[:1] if batch == 1 else (prompts * batch)[:batch]
        run(engines[method], prompts[:1], 4)  # warm-up (and a fresh prefix cache either way)
        results[(workload, batch, method)] = run(engines[method], prompts, args.max_tokens)
    for (workload, batch, method), r in results.items():
        base = results[(workload, batch, "plain")]
        rows.append({"workload": workload, "batch": batch, "method": method, "decode_tok_s": r["decode_tok_s"],
                     "speedup": r["decode_tok_s"] / base["decode_tok_s"],
                     "acceptance": r["accepted"] / r["proposed"] if r["proposed"] else None,
                     "tokens_per_step": (r["accepted"] + r["steps"]) / r["steps"] if r["steps"] else None,
                     "identical": r["tokens"] == base["tokens"], "decoded": r["decoded"]})
    print(f"\nSpeculative decoding, SmolLM2-135M-Instruct fp32, greedy, {args.threads} threads, "
          f"k={args.k}, max {args.max_tokens} tokens")
    print("workload | batch | method | decode tok/s | vs plain | acceptance | tokens/step | output = plain")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        print(f"{r['workload']} | {r['batch']} | {r['method']} | {r['decode_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{acc} | {tps} | {'yes' if r['identical'] else 'NO'}")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, out / "speculative.png")
    print(f"\nwrote {out / 'speculative.json'} and {out / 'speculative.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda x: (list(WORKLOADS).index(x[0]), x[1]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        values = [next(r["speedup"] for r in rows if (r["workload"], r["batch"]) == lab and r["method"] == m)
                  for lab in labels]
        ax.bar([i + j * width for i in range(len(labels))], values, width, label=m)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels([f"{w}\nbatch {b}" for w, b in labels], fontsize=8)
    ax.set_ylabel("decode speed vs plain")
    ax.set_title("Speculative decoding (greedy, identical output)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
