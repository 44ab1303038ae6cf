"""Weight quantization on the default model: memory, decode speed, perplexity, agreement with float.

    python benchmarks/quantization.py                       # float, bf16, int8, int4, awq (groups 32, 128), gguf
    python benchmarks/quantization.py --formats float,int8  # a subset; int4/128 = int4 with groups of 128

Each format runs in its own process (``EngineConfig.quantization``; "float" is ``none``, the
GGUF's Q4_1 blocks dequantised at load) and measures:

- weight memory: bytes of every parameter and buffer (a tied tensor once);
- decode tokens/s at batch 1 and batch 16: requests with --prompt-len-token prompts, greedy,
  ignore_eos; time from the step after every prompt is prefilled to the last token; the best
  of --repeats runs (the development machines are shared: the best run is the least disturbed);
- perplexity of benchmarks/data/public_domain.txt (see benchmarks/data/README.md), in
  --ppl-window-token windows, up to --ppl-tokens tokens, through the engine (prompt_logprobs);
- greedy agreement with float: --agree-tokens greedy tokens for each of the chat prompts below,
  the fraction of positions where the token equals float's, and how many outputs are identical.

With ``--llamacpp-python PATH`` (the venv benchmarks/setup_llamacpp.sh builds), llama.cpp runs the
same GGUF as shipped (Q4_1) on the same token ids, threads and decode lengths in its own process
(benchmarks/llamacpp_decode.py), and adds a row: batch-1 decode, perplexity and greedy agreement
(batch 16 is not measured there).

Prints a markdown table, writes JSON and a PNG plot to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve.engine.cpu_isa import CPU_ISA_CHOICES, describe_cpu

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a tip for learning to code.",
    "What does a CPU do?",
    "Describe a cat in five words.",
]
QUANTIZATION = {"float": "none", "int8": "int8", "w8a8": "w8a8_int8", "int4": "int4", "awq": "awq", "gguf": "gguf",
                "bf16": "bf16"}


# ---- one format, in a child process -------------------------------------------------------


def decode_tps(engine, batch: int, args, rep: int = 0) -> float:
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{rep}", decode_prompt(i, args), params)
    counts, start = {}, None
    while engine.has_unfinished():
        for o in engine.step():
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
        if start is None and len(counts) == batch:  # every prompt prefilled: decode steps from here
            start, first = time.perf_counter(), sum(counts.values())
    return (sum(counts.values()) - first) / (time.perf_counter() - start)


def decode_prompt(i: int, args) -> list[int]:
    return [100 + (7 * i + j) % 40000 for j in range(args.prompt_len)]


def ppl_windows(engine, args) -> list[list[int]]:
    ids = engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[: args.ppl_tokens]
    return [ids[start : start + args.ppl_window + 1] for start in range(0, len(ids) - 1, args.ppl_window)]


def chat_prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]


def perplexity(engine, args) -> tuple[float, int]:
    """Through the engine as it serves (its attention backend and kernels): each window a prompt
    whose tokens' logprobs come back (``prompt_logprobs``)."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for start, window in enumerate(ppl_windows(engine, args)):
        engine.add_request(f"ppl{start}", window, params)
        while engine.has_unfinished():
            for o in engine.step():
                if o.prompt_logprobs is not None:
                    nll -= sum(p.sampled.logprob for p in o.prompt_logprobs[1:])
                    count += len(window) - 1
    return math.exp(nll / count), count


def greedy_outputs(engine, args) -> list[list[int]]:
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.agree_tokens, ignore_eos=True)
    for i, ids in enumerate(chat_prompts(engine)):
        engine.add_request(f"g{i}", ids, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [tokens[f"g{i}"] for i in range(len(PROMPTS))]


def run_format(fmt: str, args) -> dict:
    import torch
    from tqdm import tqdm

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.quant import weight_bytes

    name, _, group = fmt.partition("/")
    bar = tqdm(total=5, desc=f"{fmt}: load", file=sys.stderr, leave=False)
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=QUANTIZATION[name], load_progress=False,
                                    quantization_group_size=int(group or args.group_size), num_kv_blocks=512,
                                    cpu_isa=args.cpu_isa))
    result = {"format": fmt, "load_s": time.perf_counter() - t, "weight_mib": weight_bytes(engine.loaded.model) / 2**20,
              "threads": torch.get_num_threads()}
    for batch in (1, 16):
        bar.update()
        bar.set_description(f"{fmt}: decode batch {batch}")
        result[f"decode_b{batch}_tok_s"] = max(decode_tps(engine, batch, args, r) for r in range(args.repeats))
    bar.update()
    bar.set_description(f"{fmt}: perplexity")
    result["perplexity"], result["ppl_tokens"] = perplexity(engine, args)
    bar.update()
    bar.set_description(f"{fmt}: greedy outputs")
    result["greedy"] = greedy_outputs(engine, args)
    result["inputs"] = {"ppl_windows": ppl_windows(engine, args), "greedy_prompts": chat_prompts(engine)}
    bar.update()
    bar.close()
    return result


def llamacpp(args, inputs: dict, threads: int) -> dict:
    """llama.cpp on the GGUF as shipped, in the venv of ``--llamacpp-python``, on ``inputs`` (the
    reference format's token ids)."""
    import tempfile

    from pdserve.engine.sources import resolve_model

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise SystemExit(f"--llamacpp-python: {args.model} is not a GGUF model")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        cmd = [args.llamacpp_python, str(Path(__file__).parent / "llamacpp_decode.py"), str(spec), str(out)]
        for extra_bufts in (True, False):
            spec.write_text(json.dumps({"model": str(source.path), "threads": threads, "extra_bufts": extra_bufts,
                                        "decode_prompt": decode_prompt(0, args), "decode_tokens": args.decode_tokens,
                                        "repeats": args.repeats, "greedy_tokens": args.agree_tokens, **inputs}))
            status = subprocess.run(cmd).returncode
            if status == 0:
                break
            # AMX in a guest whose kernel does not grant the tile state: ggml_backend_amx_mul_mat
            # segfaults (seen on a 2-core Xeon KVM guest). Without the extra buffer types it runs.
            print(f"llama.cpp died (status {status}) with its extra buffer types (AMX / repacked weights); "
                  f"measuring it without them", file=sys.stderr)
        else:
            raise SystemExit("llama.cpp failed with and without its extra buffer types")
        result = json.loads(out.read_text())
    kind = source.path.name.rsplit(".", 2)[-2] + ("" if result["extra_bufts"] else ", no extra buffer types")
    return result | {"format": f"llama.cpp {result['version']} ({kind})", "decode_b16_tok_s": None}


def child(fmt: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", fmt, *sys.argv[1:]]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        raise SystemExit(f"{fmt} run failed with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- report -------------------------------------------------------------------------------


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    return same / sum(len(r) for r in ref), sum(r == g for r, g in zip(ref, got))


def report(results: list[dict], args) -> list[dict]:
    ref = next((r for r in results if r["format"] == "float"), results[0])
    rows = []
    for r in results:
        match, identical = agreement(ref["greedy"], r["greedy"])
        rows.append({k: v for k, v in r.items() if k not in ("greedy", "inputs")} | {
            "greedy_match": match, "identical_outputs": f"{identical}/{len(PROMPTS)}",
            "b1_vs_ref": r["decode_b1_tok_s"] / ref["decode_b1_tok_s"],
            "b16_vs_ref": None if r["decode_b16_tok_s"] is None else r["decode_b16_tok_s"] / ref["decode_b16_tok_s"],
        })
    print(f"\nCPU: {describe_cpu()}" + ("" if args.cpu_isa == "auto" else f"; pdserve capped at {args.cpu_isa}"))
    print(f"model {args.model}, {ref['threads']} threads; decode: {args.prompt_len}-token prompts, "
          f"{args.decode_tokens} new tokens; perplexity over {ref['ppl_tokens']} tokens of {TEXT.name}; "
          f"agreement: {len(PROMPTS)} chat prompts x {args.agree_tokens} greedy tokens vs {ref['format']}\n")
    cols = [("format", "{}"), ("weight_mib", "{:.1f}"), ("load_s", "{:.1f}"), ("decode_b1_tok_s", "{:.1f}"),
            ("b1_vs_ref", "{:.2f}x"), ("decode_b16_tok_s", "{:.1f}"), ("b16_vs_ref", "{:.2f}x"),
            ("perplexity", "{:.3f}"), ("greedy_match", "{:.1%}"), ("identical_outputs", "{}")]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("not measured" if r[c] is None else f.format(r[c]) for c, f in cols) + " |")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("weight_mib", "weight memory (MiB)"), ("decode_b1_tok_s", "decode tokens/s, batch 1"),
               ("decode_b16_tok_s", "decode tokens/s, batch 16"), ("perplexity", "perplexity"),
               ("greedy_match", "greedy tokens equal to float")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.4 * len(metrics), 3.3))
    for ax, (key, title) in zip(axes, metrics):
        ax.bar([r["format"] for r in rows], [r[key] or 0 for r in rows], color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: smollm2-135m-instruct)")
    p.add_argument("--formats", default="float,bf16,int8,int4,awq,int4/128,awq/128,gguf",
                   help="comma-separated formats among float,bf16,int8,w8a8 (w8a8_int8),int4,awq,gguf, int4 and awq "
                        "optionally with /GROUP; float first for the ratios and agreement against it "
                        "(default: %(default)s)")
    p.add_argument("--group-size", type=int, default=32,
                   help="int4/awq group size where a format names none: 32, 64 or 128 (default: 32)")
    p.add_argument("--repeats", type=int, default=2, help="decode runs per batch size; the best counts (default: 2)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each decode request (default: 32)")
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens generated per decode request (default: 24)")
    p.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of the text scored (default: 1024)")
    p.add_argument("--ppl-window", type=int, default=512, help="context window of the perplexity pass (default: 512)")
    p.add_argument("--agree-tokens", type=int, default=16, help="greedy tokens per prompt compared (default: 16)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    p.add_argument("--llamacpp-python", default=None,
                   help="the python of llama.cpp's venv (benchmarks/setup_llamacpp.sh builds .llamacpp-venv): adds "
                        "llama.cpp on the GGUF as shipped, same token ids and threads (default: not run)")
    p.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES,
                   help="cap pdserve's instruction set (the engine's --cpu-isa), e.g. avx2 on an AVX-512 machine to "
                        "know the AVX2 figures; give --llamacpp-python a llama.cpp built the same way "
                        "(setup_llamacpp.sh --avx2) (default: auto, the processor's best)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_format(args.child, args)))
        return
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(f for f in formats if f.partition("/")[0] not in QUANTIZATION
                     or f.partition("/")[2] not in ("", *(g for g in ("32", "64", "128") if f[:3] in ("int", "awq"))))
    if unknown:
        p.error(f"--formats: unknown {unknown}; choose among {list(QUANTIZATION)}")
    t = time.time()
    results = [child(fmt, args) for fmt in formats]
    if args.llamacpp_python:
        results.append(llamacpp(args, results[0]["inputs"], results[0]["threads"]))
    rows = report(results, args)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = [{k: v for k, v in r.items() if k != "inputs"} for r in results]  # (not the token ids)
    (out / "quantization.json").write_text(json.dumps({"args": vars(args), "rows": rows, "raw": raw}, indent=2))
    plot(rows, out / "quantization.png")
    print(f"\nwrote {out / 'quantization.json'} and {out / 'quantization.png'} ({time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
