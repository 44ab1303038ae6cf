"""Decode steps eager against replayed (``--cpu-graph-max-batch``, pdserve/engine/cpu_graphs.py), side by side.

    python benchmarks/cpu_graphs.py                                  # float and int4, batches 1, 4, 8, 16
    python benchmarks/cpu_graphs.py --formats float,int8,gguf --batches 1,8 --kv-cache-dtype int8

For each weight format, in a process of its own, two engines over the same loaded model, one with every step eager
(``cpu_graph_max_batch`` 0) and one replaying decode-only steps of up to --max-batch requests (16); for each batch size,
greedy requests of --prompt-len-token prompts generate --decode-tokens tokens each (ignore_eos), decode
tokens/s timed from the step after every prompt is prefilled, the two engines alternated --repeats times
and the best of each kept (this machine is shared: the best run is the least disturbed). The first steps
of each size record and check the graph (one eager step more each); they are inside the timing. Batches
above --max-batch run eagerly in both: their ratio shows what the machine's noise is. The greedy tokens of the two
engines are compared (they must be equal). Prints a table with the CPU's flags, writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUANTIZATION = {"float": "none", "int8": "int8", "w8a8": "w8a8_int8", "int4": "int4", "gguf": "gguf", "bf16": "bf16",
                "awq": "awq"}


def decode(engine, batch: int, args, tag: str) -> tuple[float, dict[str, list[int]]]:
    """Decode tokens/s of ``batch`` requests, and their tokens."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [100 + (7 * i + j) % 40000 for j in range(args.prompt_len)], params)
    tokens: dict[str, list[int]] = {}
    start = first = None
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if start is None and len(tokens) == batch:
            start, first = time.perf_counter(), sum(map(len, tokens.values()))
    rate = (sum(map(len, tokens.values())) - first) / (time.perf_counter() - start)
    return rate, {k.split("-", 1)[1]: v for k, v in tokens.items()}


def run_format(fmt: str, args) -> list[dict]:
    """One format's rows, in this process (a child of ``main``)."""
    from tqdm import tqdm

    from pdserve.engine import EngineConfig, LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    bar = tqdm(total=len(batches) * args.repeats, desc=fmt, file=sys.stderr, leave=False)
    engines = {}
    for g in (0, args.max_batch):  # the first one loads the model (and sets the process's threads up, as its
        # first torch work), the second shares its weights
        loaded = engines[0].loaded if engines else None
        engines[g] = LLMEngine(EngineConfig(model=args.model, quantization=QUANTIZATION[fmt], load_progress=False,
                                            num_kv_blocks=1024, kv_cache_dtype=args.kv_cache_dtype,
                                            cpu_graph_max_batch=g), loaded=loaded)
    for batch in batches:
        best = {0: 0.0, args.max_batch: 0.0}
        outputs = {}
        for rep in range(args.repeats):
            for g, engine in engines.items():
                bar.set_description(f"{fmt} batch {batch}")
                rate, outputs[g] = decode(engine, batch, args, f"{fmt}{batch}r{rep}g{g}")
                best[g] = max(best[g], rate)
            bar.update()
        rows.append({"format": fmt, "batch": batch, "eager_tok_s": best[0], "graphs_tok_s": best[args.max_batch],
                     "ratio": best[args.max_batch] / best[0],
                     "same_tokens": outputs[0] == outputs[args.max_batch]})
    bar.close()
    return rows


def run(args) -> list[dict]:
    """Every format in a process of its own (the engine sets the process's threads up as its first torch work)."""
    rows = []
    for fmt in args.formats.split(","):
        cmd = [sys.executable, __file__, "--child", fmt, *sys.argv[1:]]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"{fmt} run failed with status {proc.returncode}")
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, axes = plt.subplots(1, len(formats), figsize=(4 * len(formats), 3.3), squeeze=False)
    for ax, fmt in zip(axes[0], formats):
        mine = [r for r in rows if r["format"] == fmt]
        x = range(len(mine))
        ax.bar([i - 0.2 for i in x], [r["eager_tok_s"] for r in mine], 0.4, label="eager")
        ax.bar([i + 0.2 for i in x], [r["graphs_tok_s"] for r in mine], 0.4, label="replayed")
        ax.set_xticks(list(x), [f"batch {r['batch']}" for r in mine], fontsize=8)
        ax.set_title(f"{fmt}: decode tokens/s", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: %(default)s)")
    p.add_argument("--formats", default="float,int4", help="weight formats among " + ",".join(QUANTIZATION)
                   + " (default: %(default)s)")
    p.add_argument("--batches", default="1,4,8,16,32", help="decode batch sizes (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=16, help="the replaying engine's --cpu-graph-max-batch "
                   "(default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8", "fp8"],
                   help="both engines' KV cache (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each request (default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=96, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each engine per batch, alternated; the best "
                   "counts (default: %(default)s)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: %(default)s)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_format(args.child, args)))
        return 0
    unknown = sorted(set(args.formats.split(",")) - set(QUANTIZATION))
    if unknown:
        p.error(f"--formats: unknown {unknown}; choose among {list(QUANTIZATION)}")
    import torch

    from pdserve.engine.cpu_isa import describe_cpu

    t = time.time()
    rows = run(args)
    print(f"\nCPU: {describe_cpu()}; {torch.get_num_threads()} threads; {args.model}, KV cache "
          f"{args.kv_cache_dtype}; {args.prompt_len}-token prompts, {args.decode_tokens} greedy tokens each, best of "
          f"{args.repeats}\n")
    print("| format | batch | eager tok/s | replayed tok/s | replayed / eager | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['batch']} | {r['eager_tok_s']:.1f} | {r['graphs_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_graphs.json").write_text(json.dumps({"args": vars(args), "cpu": describe_cpu(), "rows": rows},
                                                    indent=2))
    plot(rows, out / "cpu_graphs.png")
    print(f"\nwrote {out / 'cpu_graphs.json'} and {out / 'cpu_graphs.png'} ({time.time() - t:.0f} s)")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
