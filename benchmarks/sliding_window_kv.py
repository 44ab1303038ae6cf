"""KV bytes per sequence with the sliding-window cache (block tables per layer group) against a
cache that keeps every block, for Gemma 3 270M (18 layers: 15 with a 512-token window, 3 global).

    python benchmarks/sliding_window_kv.py              # about a minute on 2 cores
    python benchmarks/sliding_window_kv.py --no-engine  # the allocator only: seconds

For each sequence length (a prompt of length - 64 tokens, then 64 decoded tokens): the bytes the
sequence's blocks hold at the end, and the most they held at any step (the prompt's chunks, of
--step-tokens, hold their window plus the chunk in the local layers); and the bytes a
disaggregated transfer of a prompt of that length ships (every layer's blocks, or a local layer's
from the next token's window on: ``KVLayout.first_block``, the rule the exporter and receiver use).
Both caches run through the engine's own scheduler and KV cache manager, step by step, with the
model's outputs replaced by a fixed token: which blocks are held depends on positions only, not
on the tokens. One length
(--engine-tokens) also runs through the real engine (model weights from the gemma3 package, or
random weights of the same shape without it), whose blocks held must equal the allocator's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DECODE = 64


def blocks_held(groups, lengths: int, block_size: int, step_tokens: int) -> tuple[int, int]:
    """(blocks at the end, most blocks at any step) of one sequence of ``lengths`` tokens."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager, cdiv
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import ModelOutput, Scheduler

    num_blocks = cdiv(lengths, block_size) * groups.num_groups + 2
    kv = (HybridKVCacheManager(num_blocks, block_size, groups) if groups.num_groups > 1
          else KVCacheManager(num_blocks, block_size))
    scheduler = Scheduler(kv, step_tokens, 1)
    request = Request("s", [7] * (lengths - DECODE), SamplingParams(max_tokens=DECODE, ignore_eos=True))
    scheduler.add_request(request)
    held = peak = 0
    while request.num_tokens < lengths:
        sched = scheduler.schedule()
        out = ModelOutput()
        out.sampled_token_ids = {item.request.request_id: [7] for item in sched.scheduled if item.sample}
        held = _held(kv, "s")
        peak = max(peak, held)
        scheduler.update(sched, out)
    return held, peak


def _held(kv, request_id: str) -> int:
    if hasattr(kv, "num_blocks_held"):
        return kv.num_blocks_held(request_id)
    return len(kv.block_ids(request_id))


def engine_blocks(model: str, lengths: int, step_tokens: int, sliding: bool) -> tuple[int, int, float]:
    """(blocks held after the last decode step, block bytes, seconds) from the real engine."""
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory_gb=2.0, max_num_batched_tokens=step_tokens,
                                    sliding_window_kv=sliding, load_progress=False))
    prompt = [(i * 7919) % 20000 + 1000 for i in range(lengths - DECODE)]
    engine.add_request("s", prompt, SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True))
    start, held = time.perf_counter(), 0
    while engine.has_unfinished():
        request = engine.scheduler.requests.get("s")
        if request is not None:
            held = _held(engine.kv, "s")  # before the step that finishes it (its blocks then go back)
        engine.step()
    return held, engine.kv_block_bytes, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048,8192,32768", help="sequence lengths (prompt + 64 decoded tokens)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--step-tokens", type=int, default=2048, help="the engine's step budget (prompt chunk size)")
    p.add_argument("--engine-tokens", type=int, default=2048, help="the length also run through the real engine")
    p.add_argument("--no-engine", action="store_true", help="the allocator only (no model run)")
    p.add_argument("--dtype-bytes", type=int, default=4, help="bytes per cache element (4: float32)")
    p.add_argument("--result-dir", default="bench-results", help="where the JSON goes (default: %(default)s)")
    args = p.parse_args()

    from pdserve.engine.config import PRESETS
    from pdserve.engine.cpu_isa import describe_cpu
    from pdserve.engine.kv_cache_manager import cdiv, kv_groups
    from pdserve.kvtransfer.base import KVLayout

    cfg = PRESETS["gemma-3-270m"]
    hybrid, plain = kv_groups(cfg, True), kv_groups(cfg, False)
    per_layer_block = 2 * cfg.num_kv_heads * cfg.head_dim * args.block_size * args.dtype_bytes
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        row = {"tokens": n}
        for name, groups in (("every_block", plain), ("sliding", hybrid)):
            held, peak = blocks_held(groups, n, args.block_size, args.step_tokens)
            block_bytes = per_layer_block * groups.num_slots
            row[name] = {"blocks": held, "bytes": held * block_bytes, "peak_bytes": peak * block_bytes}
            layout = KVLayout("", "float32", args.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                              layer_windows=groups.layer_windows if groups.num_groups > 1 else ())
            blocks = cdiv(n, args.block_size)
            row[name]["transfer_bytes"] = per_layer_block * sum(blocks - layout.first_block(layer, n)
                                                                for layer in range(cfg.num_layers))
        rows.append(row)
    engine = None
    if not args.no_engine:
        from pdserve.engine.sources import resolve_model

        try:
            resolve_model("gemma-3-270m")
            model = "gemma-3-270m"
        except Exception:  # the package is not installed: the same shape, random weights
            model = "random:gemma-3-270m"
        from tqdm import tqdm

        engine = {"model": model, "tokens": args.engine_tokens}
        for name, sliding in tqdm((("every_block", False), ("sliding", True)), desc=f"{model}, the real engine"):
            held, block_bytes, seconds = engine_blocks(model, args.engine_tokens, args.step_tokens, sliding)
            engine[name] = {"blocks": held, "bytes": held * block_bytes, "seconds": round(seconds, 1)}

    print(f"# {describe_cpu()}")
    print(f"# Gemma 3 270M: {cfg.num_layers} layers ({sum(map(cfg.is_sliding, range(cfg.num_layers)))} with a "
          f"{cfg.sliding_window}-token window), {cfg.num_kv_heads} KV head of {cfg.head_dim}, float32 cache, "
          f"blocks of {args.block_size}, prompt chunks of {args.step_tokens}")
    print("| tokens | every block: MiB | sliding-window cache: MiB | ratio | peak, every block | peak, sliding "
          "| transfer, every block | transfer, sliding |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for row in rows:
        a, b = row["every_block"], row["sliding"]
        print(f"| {row['tokens']} | {a['bytes'] / mib:.1f} | {b['bytes'] / mib:.1f} | {b['bytes'] / a['bytes']:.3f} "
              f"| {a['peak_bytes'] / mib:.1f} | {b['peak_bytes'] / mib:.1f} "
              f"| {a['transfer_bytes'] / mib:.1f} | {b['transfer_bytes'] / mib:.1f} |")
    if engine is not None:
        a, b = engine["every_block"], engine["sliding"]
        check = next((r for r in rows if r["tokens"] == engine["tokens"]), None)
        agree = "" if check is None else (
            "; the allocator's figures: " + ("equal" if (check["every_block"]["blocks"], check["sliding"]["blocks"])
                                             == (a["blocks"], b["blocks"]) else "DIFFERENT"))
        print(f"\nreal engine ({engine['model']}), {engine['tokens']} tokens: every block {a['bytes'] / mib:.1f} MiB "
              f"({a['seconds']} s), sliding {b['bytes'] / mib:.1f} MiB ({b['seconds']} s){agree}")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sliding_window_kv.json").write_text(json.dumps({"rows": rows, "engine": engine}, indent=1))


if __name__ == "__main__":
    main()
