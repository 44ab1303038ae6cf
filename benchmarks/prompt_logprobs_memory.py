"""A worker's memory under prompt-logprobs requests of growing prompts (``echo`` + ``logprobs`` on
/v1/completions, vLLM's ``prompt_logprobs``): the heap's size and resident memory after each.

    python benchmarks/prompt_logprobs_memory.py                  # the engine as it is
    python benchmarks/prompt_logprobs_memory.py --whole-chunks   # as before: logits of a chunk at once, no HeapBound

The engine (``--model``, default the tiny random model) serves one request at a time, prompts of
``--step``, 2 x ``--step``, ... up to ``--max-prompt`` tokens, each with ``prompt_logprobs=0`` and one
output token. After each: resident memory (VmRSS), glibc's heap (all arenas' ``arena``, what the
process took with brk/mmap for them) and what of it is in use (``uordblks``). ``--whole-chunks`` puts
back the old behaviour (every row of a chunk's logits in one block, the heap never trimmed), which
grew the heap by about each prompt's logits; stops early past ``--stop-mib`` resident. Prints the
table and the CPU's flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.configs import from_dict  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.cpu_isa import describe_cpu  # noqa: E402
from pdserve.engine.cpu_kernels import HeapBound, resident_bytes  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny", help="model to load (default: random:tiny)")
    p.add_argument("--step", type=int, default=64, help="prompt lengths grow by this many tokens (default 64)")
    p.add_argument("--max-prompt", type=int, default=1984, help="the longest prompt (default 1984)")
    p.add_argument("--whole-chunks", action="store_true",
                   help="the old behaviour: a chunk's logits in one block, no HeapBound")
    p.add_argument("--stop-mib", type=int, default=4096, help="stop past this resident size (default 4096)")
    args = p.parse_args(argv)
    engine = LLMEngine(from_dict(EngineConfig, {"model": args.model, "num_kv_blocks": 256,
                                                "load_progress": False}))
    bound = HeapBound.create()
    if bound is None:
        print("needs glibc 2.33 or later (mallinfo2)")
        return 2
    if args.whole_chunks:
        engine.runner._prompt_logprobs_rows, engine.heap = 1 << 30, None

    def row(label: str) -> None:
        info = bound.info()
        print(f"| {label} | {resident_bytes() >> 20} | {info.arena >> 20} | {info.uordblks >> 20} |", flush=True)

    print(f"{args.model}; {'whole chunks, no heap bound (before)' if args.whole_chunks else 'as the engine runs'}")
    print("| prompt tokens | resident MiB | heap MiB | heap in use MiB |")
    print("|---|---|---|---|")
    row("before the first")
    for i, n in enumerate(range(args.step, args.max_prompt + 1, args.step)):
        engine.add_request(str(i), [100 + (j * 7 + i) % 30000 for j in range(n)],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        while engine.has_unfinished():
            engine.step()
        row(str(n))
        if resident_bytes() >> 20 > args.stop_mib:
            print(f"stopped: over {args.stop_mib} MiB resident")
            break
    print(describe_cpu())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
