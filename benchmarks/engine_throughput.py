"""Engine throughput: pdserve's engine against transformers ``generate`` on the same workload.

    python benchmarks/engine_throughput.py                     # the full run (several minutes)
    python benchmarks/engine_throughput.py --skip-transformers # ours and the machine ceilings only

Workload: 64 requests, prompt lengths uniform in [32, 512], output lengths uniform in [16, 256]
(ignore_eos), all submitted at once, SmolLM2-135M-Instruct in float32, greedy. transformers runs
the same requests in static padded batches of 16 (each batch generates its longest output;
only each request's own tokens count). Each engine runs in its own process, so its load time
and peak RSS are its own. The machine's ceilings are measured in the same run: fp32 matmul
GFLOP/s (a large torch.mm) and memory read bandwidth (a large tensor sum).

Prints a table with ratios, writes JSON and a PNG plot to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

START = time.time()


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_prompts):
        n = rng.randint(args.input_min, args.input_max)
        reqs.append(([rng.randrange(100, 49000) for _ in range(n)], rng.randint(args.output_min, args.output_max)))
    return reqs


# ---- measurements, each run in a child process ----------------------------------------


def ceilings(_args) -> dict:
    import torch

    # Medians, not bests: this machine is shared, and its best moments would set a ceiling the
    # engines, measured over minutes, cannot be held to.
    def median_time(fn, reps):
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    n = 4096
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / median_time(lambda: torch.mm(a, b), 7)
    x = torch.ones(512 * 2**20 // 4)  # 512 MiB
    bandwidth = x.numel() * 4 / median_time(lambda: x.sum(), 15)
    return {"matmul_gflops": flops / 1e9, "read_gbps": bandwidth / 1e9, "threads": torch.get_num_threads()}


def run_ours(args) -> dict:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, load_progress=False, kv_cache_memory_gb=args.kv_gb,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    ready = time.time() - START
    params = engine.loaded.config.num_params
    result = {"ready_s": ready, "params": params}

    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def drain():
        firsts, lasts, counts = {}, {}, {}
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                firsts.setdefault(o.request_id, now)
                lasts[o.request_id] = now
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
        return firsts, lasts, counts

    # warm-up
    engine.add_request("warm", list(range(100, 164)), greedy(4))
    drain()
    reqs = workload(args)
    from tqdm import tqdm

    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(str(i), prompt, greedy(out_len))
    bar = tqdm(total=len(reqs), desc="ours: workload", unit="req", file=sys.stderr)
    out_tokens = 0
    while engine.has_unfinished():
        for o in engine.step():
            out_tokens += len(o.new_token_ids)
            bar.update(int(o.finished))
    bar.close()
    wall = time.perf_counter() - t0
    result.update(workload_s=wall, output_tokens=out_tokens,
                  prompt_tokens=sum(len(p) for p, _ in reqs))

    # single-request decode: 128-token prompt, 128 new tokens; time between first and last token
    rng = random.Random(1)
    engine.add_request("single", [rng.randrange(100, 49000) for _ in range(128)], greedy(129))
    firsts, lasts, counts = drain()
    result["single_decode_tps"] = (counts["single"] - 1) / (lasts["single"] - firsts["single"])

    # prefill of one 2048-token prompt
    engine.add_request("prefill", [rng.randrange(100, 49000) for _ in range(2048)], greedy(1))
    t = time.perf_counter()
    drain()
    result["prefill_tps"] = 2048 / (time.perf_counter() - t)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    return result


def run_transformers(args) -> dict:
    import torch
    import transformers
    from tqdm import tqdm

    from pdserve.engine.sources import resolve_model

    source = resolve_model(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
    ).eval()
    ready = time.time() - START
    result = {"ready_s": ready}
    reqs = workload(args)

    def generate(batch, max_new):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)

    generate([list(range(100, 164))], 4)  # warm-up
    t0 = time.perf_counter()
    useful = 0
    for i in tqdm(range(0, len(reqs), args.hf_batch), desc="transformers: workload", unit="batch", file=sys.stderr):
        batch = reqs[i : i + args.hf_batch]
        generate([p for p, _ in batch], max(n for _, n in batch))
        useful += sum(n for _, n in batch)
    result.update(workload_s=time.perf_counter() - t0, output_tokens=useful,
                  prompt_tokens=sum(len(p) for p, _ in reqs))

    rng = random.Random(1)
    prompt = [rng.randrange(100, 49000) for _ in range(128)]
    t = time.perf_counter()
    generate([prompt], 1)
    first = time.perf_counter() - t
    t = time.perf_counter()
    generate([prompt], 129)
    result["single_decode_tps"] = 128 / (time.perf_counter() - t - first)
    long = [rng.randrange(100, 49000) for _ in range(2048)]
    t = time.perf_counter()
    generate([long], 1)
    result["prefill_tps"] = 2048 / (time.perf_counter() - t)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


# ---- the parent: spawn, collect, report -----------------------------------------------


def child(kind: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, *sys.argv[1:]]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        raise SystemExit(f"{kind} run failed with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(ceil: dict, ours: dict, hf: dict | None, args) -> dict:
    params = ours["params"]
    weight_bytes = params * 4
    bound = ceil["read_gbps"] * 1e9 / weight_bytes
    rows = []

    def engine_rows(name, r):
        tokens = r["prompt_tokens"] + r["output_tokens"]
        mfu = tokens * 2 * params / r["workload_s"] / (ceil["matmul_gflops"] * 1e9)
        return {
            "engine": name,
            "output_tok_s": r["output_tokens"] / r["workload_s"],
            "workload_s": r["workload_s"],
            "mfu": mfu,
            "single_decode_tok_s": r["single_decode_tps"],
            "single_decode_of_bound": r["single_decode_tps"] / bound,
            "prefill_tok_s": r["prefill_tps"],
            "peak_rss_mb": r["peak_rss_mb"],
            "ready_s": r["ready_s"],
        }

    rows.append(engine_rows("pdserve", ours))
    if hf:
        rows.append(engine_rows("transformers", hf))
    print(f"\nmachine: {ceil['threads']} threads, fp32 matmul {ceil['matmul_gflops']:.1f} GFLOP/s, "
          f"read bandwidth {ceil['read_gbps']:.1f} GB/s")
    print(f"model: {params / 1e6:.1f} M parameters, {weight_bytes / 1e6:.0f} MB of fp32 weights per decode step; "
          f"bandwidth bound {bound:.1f} tokens/s")
    print(f"workload: {args.num_prompts} requests, prompts {args.input_min}-{args.input_max}, "
          f"outputs {args.output_min}-{args.output_max}; {ours['prompt_tokens']} prompt + "
          f"{ours['output_tokens']} output tokens\n")
    cols = [("engine", "{}"), ("output_tok_s", "{:.1f}"), ("workload_s", "{:.1f}"), ("mfu", "{:.1%}"),
            ("single_decode_tok_s", "{:.1f}"), ("single_decode_of_bound", "{:.1%}"), ("prefill_tok_s", "{:.0f}"),
            ("peak_rss_mb", "{:.0f}"), ("ready_s", "{:.1f}")]
    print(" | ".join(c for c, _ in cols))
    print(" | ".join("---" for _ in cols))
    for r in rows:
        print(" | ".join(f.format(r[c]) for c, f in cols))
    if hf:
        a, b = rows
        print(f"\nratios pdserve / transformers: output tokens/s {a['output_tok_s'] / b['output_tok_s']:.2f}x, "
              f"single-request decode {a['single_decode_tok_s'] / b['single_decode_tok_s']:.2f}x, "
              f"prefill {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x")
    return {"ceilings": ceil, "rows": rows, "bound_tok_s": bound}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    metrics = [("output_tok_s", "workload output tokens/s"), ("single_decode_tok_s", "single-request decode tokens/s"),
               ("prefill_tok_s", "prefill tokens/s (2048-token prompt)"), ("ready_s", "seconds to model ready")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5))
    for ax, (key, title) in zip(axes, metrics):
        ax.bar([r["engine"] for r in rows], [r[key] for r in rows], color=["tab:blue", "tab:gray"][: len(rows)])
        ax.set_title(title, fontsize=9)
        if key == "single_decode_tok_s":
            ax.axhline(summary["bound_tok_s"], ls="--", c="k", lw=1)
            ax.text(0, summary["bound_tok_s"], "bandwidth bound", fontsize=7, va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model for both engines (default: the default)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default: 64)")
    p.add_argument("--input-min", type=int, default=32, help="shortest prompt in tokens (default: 32)")
    p.add_argument("--input-max", type=int, default=512, help="longest prompt in tokens (default: 512)")
    p.add_argument("--output-min", type=int, default=16, help="shortest output in tokens (default: 16)")
    p.add_argument("--output-max", type=int, default=256, help="longest output in tokens (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers static batch size (default: 16)")
    p.add_argument("--kv-gb", type=float, default=4.0, help="pdserve KV-cache budget in GiB (default: 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="pdserve token budget per step (default: 2048)")
    p.add_argument("--skip-transformers", action="store_true", help="measure pdserve and the ceilings only")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    p.add_argument("--child", choices=["ceilings", "ours", "transformers"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = {"ceilings": ceilings, "ours": run_ours, "transformers": run_transformers}[args.child]
        print(json.dumps(fn(args)))
        return
    ceil = child("ceilings", args)
    ours = child("ours", args)
    hf = None if args.skip_transformers else child("transformers", args)
    summary = report(ceil, ours, hf, args)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_throughput.json").write_text(json.dumps({"args": vars(args), **summary, "raw": {
        "ours": ours, "transformers": hf}}, indent=2))
    plot(summary, out / "engine_throughput.png")
    print(f"\nwrote {out / 'engine_throughput.json'} and {out / 'engine_throughput.png'}")


if __name__ == "__main__":
    main()
