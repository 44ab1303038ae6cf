"""KV-cache dtypes: what bfloat16, int8 and fp8 caches cost and buy, against the float32 cache.

    python benchmarks/kv_cache_quant.py                     # about 4 minutes on 2 cores
    python benchmarks/kv_cache_quant.py --quantization bf16 --dtypes auto,bfloat16

For each cache dtype (auto = float32, bfloat16, int8, fp8), same model (SmolLM2-135M-Instruct,
float32 weights or --quantization's) and same run: KV bytes per token (what a transfer ships per
prompt token), blocks in 1 GiB, tokens/s from the first token to the last at batch 1 and 16 (prompts
of --prompt-len tokens, --max-tokens greedy tokens each; the 16 are added at once, so their prefills
count too: benchmarks/decode_steps.py times decode steps alone), and greedy agreement with the
first dtype's cache (the fraction of generated tokens before each request's first difference), and
the perplexity of benchmarks/data/public_domain.txt through the engine with each cache (as
benchmarks/quantization.py scores it: each window a prompt, its tokens' logprobs from the kernels
that serve it).
Prints a table with the processor's flags; writes JSON to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def decode_run(engine, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from pdserve.engine import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, last, tokens = {}, {}, {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    span = max(last.values()) - min(first.values())
    return sum(len(t) - 1 for t in tokens.values()) / span, [tokens[f"r{i}"] for i in range(len(prompts))]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions, before each pair's first difference, over all positions."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same += n
        total += len(x)
    return same / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--dtypes", default="auto,bfloat16,int8,fp8",
                   help="cache dtypes to run, comma-separated, the first the baseline (default: %(default)s)")
    p.add_argument("--quantization", default="none",
                   help="the weights: none (float32) or any of EngineConfig.quantization's (default: %(default)s)")
    p.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of the text scored (default: %(default)s)")
    p.add_argument("--ppl-window", type=int, default=512,
                   help="context window of the perplexity pass (default: %(default)s)")
    p.add_argument("--result-dir", default="bench-results", help="where the JSON goes (default: %(default)s)")
    args = p.parse_args()

    import torch
    from tqdm import tqdm

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.cpu_isa import describe_cpu
    from pdserve.engine.loader import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quantization import perplexity

    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    loaded = load_model(progress=True, quantization=args.quantization)
    tok = loaded.tokenizer
    rng = random.Random(0)
    words = ("the river city light stone winter garden music letter window morning story harbor field "
             "voice paper bridge forest engine market").split()
    prompts = []
    for _ in range(16):
        text = " ".join(rng.choice(words) for _ in range(args.prompt_len))
        prompts.append(tok.encode(text)[: args.prompt_len])
    rows, outputs = [], {}
    for dtype in tqdm(dtypes, desc="kv cache dtypes", file=sys.stderr):
        engine = LLMEngine(EngineConfig(load_progress=False, kv_cache_dtype=dtype, kv_cache_memory_gb=1.0,
                                        num_threads=args.threads, quantization=args.quantization), loaded=loaded)
        cache = engine.runner.kv_cache
        per_token = cache[:, :, 0].numel() * cache.element_size() / engine.block_size
        decode_run(engine, prompts[:1], 4)  # warm-up
        one, out1 = decode_run(engine, prompts[:1], args.max_tokens)
        sixteen, out16 = decode_run(engine, prompts[1:], args.max_tokens)
        outputs[dtype] = out1 + out16
        ppl, _ = perplexity(engine, args)
        name = str(cache.dtype).removeprefix("torch.") if dtype == "auto" else dtype
        rows.append({"dtype": name, "bytes_per_token": per_token, "blocks_per_gib": engine.kv.num_blocks,
                     "tok_s_1": one, "tok_s_16": sixteen, "perplexity": ppl})
    for row, dtype in zip(rows, dtypes):
        row["agreement"] = agreement(outputs[dtype], outputs[dtypes[0]])
    base = rows[0]
    weights = "float32" if args.quantization == "none" else args.quantization
    print(f"\nCPU: {describe_cpu()}")
    print(f"KV-cache dtype, SmolLM2-135M-Instruct {weights} weights, {args.threads} threads, prompts of "
          f"{args.prompt_len} tokens, {args.max_tokens} greedy tokens; perplexity over {args.ppl_tokens} tokens")
    print(f"KV cache | bytes/token | vs {base['dtype']} | blocks in 1 GiB | decode tok/s, batch 1 | batch 16 | "
          f"greedy agreement with {base['dtype']} | perplexity")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        print(f"{r['dtype']} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / base['bytes_per_token']:.2f}x | "
              f"{r['blocks_per_gib']} | {r['tok_s_1']:.1f} ({r['tok_s_1'] / base['tok_s_1']:.2f}x) | "
              f"{r['tok_s_16']:.1f} ({r['tok_s_16'] / base['tok_s_16']:.2f}x) | {r['agreement']:.1%} | "
              f"{r['perplexity']:.3f}")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_cache_quant.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
