"""Decode step time by batch size on this processor: the engine of the default model (float32, 2
threads), each batch of requests prefilled (512-token prompts), then ``--steps`` decode steps timed.
Shows where the projections' path changes (the C few-rows kernel up to the row count measured for
this machine, engine/cpu_measured.py, then the ``linear_path``), and with ``--few-rows N`` what
another threshold would give.

    python benchmarks/decode_steps.py                  # this processor's thresholds
    python benchmarks/decode_steps.py --few-rows 4     # the C kernel up to 4 rows only
    python benchmarks/decode_steps.py --quantization bf16 --kv-cache-dtype auto,bfloat16
                                                       # bf16 weights, each cache dtype in turn

Prints the table (ms per step, tokens per second) with the processor's flags.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pdserve.engine.cpu_isa import describe_cpu  # noqa: E402
from pdserve.engine.model import Linear  # noqa: E402


def time_decode_steps(engine: LLMEngine, batch: int, prompt: int, steps: int) -> float:
    """Seconds per decode step of ``batch`` requests, each prefilled with ``prompt`` random tokens first."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 40000) for _ in range(prompt)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    engine.step()  # a first decode step outside the timing
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - started) / steps
    engine.abort_request(ids)
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model (default: smollm2-135m-instruct)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--batches", default="1,2,3,4,5,6,8,12,16", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request (default: 512)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size (default: 20)")
    parser.add_argument("--quantization", default="none", help="the weights (EngineConfig.quantization; default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV-cache dtypes, comma-separated: columns each (EngineConfig.kv_cache_dtype; "
                             "default: auto)")
    parser.add_argument("--few-rows", type=int, default=None,
                        help="override the C kernel's row threshold (default: this machine's, cpu_measured)")
    args = parser.parse_args()
    kv_dtypes = args.kv_cache_dtype.split(",")
    engines = [LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, load_progress=False,
                                      enable_prefix_caching=False, quantization=args.quantization,
                                      kv_cache_dtype=kv)) for kv in kv_dtypes]
    linears = [m for m in engines[0].runner.model.modules() if isinstance(m, Linear)]
    if args.few_rows is not None:
        for engine in engines:
            for m in engine.runner.model.modules():
                if isinstance(m, Linear):
                    m.few_rows = args.few_rows
    print(f"CPU: {describe_cpu()}")
    if linears:
        print(f"C kernel up to {linears[0].few_rows} rows, then {linears[0].path}")
    print(f"weights: {args.quantization}; {args.prompt}-token prompts\n")
    print("| batch | " + " | ".join(f"ms per step, KV {kv} | tokens/s" for kv in kv_dtypes) + " |")
    print("|---:|" + "---:|---:|" * len(kv_dtypes))
    for b in (int(x) for x in args.batches.split(",")):
        cells = []
        for engine in engines:
            step = time_decode_steps(engine, b, args.prompt, args.steps)
            cells.append(f"{step * 1000:.1f} | {b / step:.1f}")
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
