"""The shipped models side by side, each against transformers on the same prompts.

    python benchmarks/models.py                                  # smollm2-135m-instruct and gemma-3-270m
    python benchmarks/models.py --models gemma-3-270m --skip-transformers

For each model, in its own process per engine (so load time and memory are that engine's):

- load: process-side seconds from nothing to a model ready to run (ours: ``load_model``;
  transformers: ``from_pretrained`` on the same GGUF file, which dequantises it itself);
- prefill tokens/s: one --prefill-tokens prompt (public-domain text, benchmarks/data), one
  forward over it (ours: a request with max_tokens=1, through the engine; transformers: one
  ``model(ids)`` call); the median of --repeats;
- decode tokens/s: one stream, --decode-tokens greedy tokens after a 32-token prompt (ours: the
  engine's steps after the first token; transformers: ``generate`` with its KV cache, minus the
  prompt's forward); the median of --repeats;
- KV bytes per token of context, as each engine stores it in float32, and at 2k, 8k and 32k tokens
  per sequence: every layer keeping every token (transformers' cache; ours with
  --no-sliding-window-kv), and Gemma 3's local layers keeping only their last 512 (ours by
  default; benchmarks/sliding_window_kv.py measures it through the engine's allocator).

Prints a markdown table with the CPU's flags, writes JSON to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "public_domain.txt"


def ours(model: str, args) -> dict:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pdserve.engine.loader import load_model

    t = time.perf_counter()
    loaded = load_model(model, progress=False)
    result = {"load_s": time.perf_counter() - t, "threads": torch.get_num_threads()}
    # A memory budget, not a block count: with layer groups (Gemma) a block holds 3 of the 18 layers.
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory_gb=1.0, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(2048, args.prefill_tokens), load_progress=False),
                       loaded=loaded)
    text_ids = loaded.tokenizer.encode(TEXT.read_text())

    def run(rid: str, prompt: list[int], tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds from it to the last)."""
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        start, first = time.perf_counter(), None
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        return first - start, time.perf_counter() - first

    prefill, decode = [], []
    for r in range(args.repeats + 1):  # the first of each is a warm-up
        ttft, _ = run(f"p{r}", text_ids[r : r + args.prefill_tokens], 1)
        prefill.append(args.prefill_tokens / ttft)
        _, rest = run(f"d{r}", text_ids[100 + r : 132 + r], args.decode_tokens + 1)
        decode.append(args.decode_tokens / rest)
    cfg = loaded.config
    result |= {"prefill_tok_s": statistics.median(prefill[1:]), "decode_tok_s": statistics.median(decode[1:]),
               "kv_bytes_per_token": cfg.kv_bytes_per_token(4), "params": cfg.num_params,
               "kv_window_bytes_per_token": kv_window_bytes(cfg)}
    return result


def kv_window_bytes(cfg) -> dict:
    """Bytes per sequence at 2k/8k/32k tokens: every layer keeping every token, and local layers
    keeping only their window (the tokens; our cache holds them in whole blocks, a little more)."""
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    out = {}
    for n in (2048, 8192, 32768):
        windowed = sum(per_layer * (min(n, cfg.sliding_window) if cfg.is_sliding(i) else n)
                       for i in range(cfg.num_layers))
        out[str(n)] = {"all_tokens": per_layer * cfg.num_layers * n, "window": windowed}
    return out


def theirs(model: str, args) -> dict:
    import torch
    import transformers

    from pdserve.engine.sources import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    path = resolve_model(model).path
    t = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    result = {"load_s": time.perf_counter() - t, "threads": torch.get_num_threads()}
    text_ids = load_tokenizer(model).encode(TEXT.read_text())  # the same ids as ours
    prefill, decode = [], []
    with torch.inference_mode():
        for r in range(args.repeats + 1):
            ids = torch.tensor([text_ids[r : r + args.prefill_tokens]])
            t = time.perf_counter()
            hf(ids, use_cache=False)
            prefill.append(args.prefill_tokens / (time.perf_counter() - t))
            ids = torch.tensor([text_ids[100 + r : 132 + r]])
            t = time.perf_counter()
            hf(ids)
            prompt_s = time.perf_counter() - t
            t = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_tokens + 1,
                        min_new_tokens=args.decode_tokens + 1, do_sample=False, pad_token_id=0)
            decode.append(args.decode_tokens / max(time.perf_counter() - t - prompt_s, 1e-9))
    return result | {"prefill_tok_s": statistics.median(prefill[1:]), "decode_tok_s": statistics.median(decode[1:])}


def child(engine: str, model: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, model, *sys.argv[1:]]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        raise SystemExit(f"{engine} on {model} failed with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m", help="comma-separated model names")
    p.add_argument("--prefill-tokens", type=int, default=1024,
                   help="prompt tokens of the prefill figure (default: 1024)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the decode figure (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="measured repetitions; the median counts (default: 3)")
    p.add_argument("--skip-transformers", action="store_true", help="only pdserve's figures")
    p.add_argument("--result-dir", default="bench-results", help="where the JSON goes (default: bench-results)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        engine, model = args.child
        print(json.dumps((ours if engine == "pdserve" else theirs)(model, args)))
        return

    from tqdm import tqdm

    from pdserve.engine.cpu_isa import describe_cpu

    models = args.models.split(",")
    engines = ["pdserve"] + ([] if args.skip_transformers else ["transformers"])
    results = {}
    with tqdm(total=len(models) * len(engines), desc="models", file=sys.stderr) as bar:
        for model in models:
            for engine in engines:
                bar.set_description(f"{model}: {engine}")
                results[(model, engine)] = child(engine, model, args)
                bar.update()
    print(f"\nCPU: {describe_cpu()}")
    print(f"prefill: one {args.prefill_tokens}-token prompt; decode: one stream, {args.decode_tokens} tokens; "
          f"float32, median of {args.repeats}\n")
    print("| model | engine | load (s) | prefill tok/s | ratio | decode tok/s | ratio | KV bytes/token |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        ref = results.get((model, "transformers"))
        for engine in engines:
            r = results[(model, engine)]
            prefill, decode = (f"{r[k] / ref[k]:.2f}x" if ref else "-" for k in ("prefill_tok_s", "decode_tok_s"))
            kv = f"{r['kv_bytes_per_token']:,}" if "kv_bytes_per_token" in r else ""
            print(f"| {model} | {engine} | {r['load_s']:.1f} | {r['prefill_tok_s']:.0f} | {prefill} "
                  f"| {r['decode_tok_s']:.1f} | {decode} | {kv} |")
    print("\nKV bytes per sequence (float32): every layer keeping every token (transformers) / local layers keeping "
          "their window (ours)")
    for model in models:
        for n, b in results[(model, "pdserve")]["kv_window_bytes_per_token"].items():
            print(f"- {model}, {int(n):,} tokens: {b['all_tokens'] / 2**20:,.0f} MiB / {b['window'] / 2**20:,.0f} MiB")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "models.json").write_text(json.dumps({f"{m}/{e}": r for (m, e), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
