"""pdserve's engine against vLLM's CPU build, side by side on the same token ids (issue 13's table).

    python benchmarks/engine_vs_vllm.py                                   # pdserve alone
    python benchmarks/engine_vs_vllm.py --vllm-python .vllm-venv/bin/python   # and vLLM (setup_vllm_cpu.sh)
    python benchmarks/engine_vs_vllm.py --vllm-python ... --isa native,avx2 --pdserve float32,bf16

Workloads (greedy, ignore_eos, fixed output lengths, fresh random prompt ids per repetition so no
prefix is reused; prefix caching off in both engines), each repeated --reps times, medians kept:
  batch64    64 requests, prompts uniform in 64-1,024 tokens, 128 output tokens, all at once: output tok/s
  batch32    32 requests x 128 in / 128 out, all at once: output tok/s
  prefill    one 2,048-token prompt, one output token: prompt tok/s
  decode     one 8-token prompt, 128 output tokens: output tok/s
plus process start to ready (model loaded) and peak RSS (the sum of each process's peak), and
  prefill_mfu  the prefill's model FLOPs (projections, causal attention, the LM head for one token)
               per second over the processor's matmul peak in the run's precision (the best of a few
               large torch.mm shapes with the engines' threads, measured after the engines)

Each engine runs in its own process, one after the other, after the machine has been quiet
(1-minute load under --quiet-load, waited for up to --quiet-wait-s); the CPU time other processes
took while it ran ("foreign load", in cores) is recorded next to its figures. --isa avx2 caps both
engines below AVX-512 (pdserve: --cpu-isa avx2; vLLM: vllm_cpu.py --isa avx2), so the AVX2
figures of an AVX-512 machine are known. Greedy outputs are compared request by request.

Prints the table with the processor's flags, writes JSON and a PNG plot to --result-dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pdserve.engine.cpu_isa import describe_cpu

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"batch64": "output tok/s", "batch32": "output tok/s", "prefill": "prompt tok/s",
             "decode": "output tok/s"}


def phases(reps: int, seed: int) -> list[dict]:
    """A warm-up, then each workload ``reps`` times, interleaved, every prompt fresh."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    def req(n_in: int, n_out: int) -> dict:
        return {"prompt_token_ids": ids(n_in), "max_tokens": n_out, "ignore_eos": True, "detokenize": False}

    out = [{"name": "warmup", "requests": [req(64, 8)]}]
    for r in range(reps):
        out += [{"name": f"batch64/{r}", "requests": [req(rng.randint(64, 1024), 128) for _ in range(64)]},
                {"name": f"batch32/{r}", "requests": [req(128, 128) for _ in range(32)]},
                {"name": f"prefill/{r}", "requests": [req(2048, 1)]},
                {"name": f"decode/{r}", "requests": [req(8, 128)]}]
    return out


# ---- pdserve's side (a child process, as vLLM's) ----------------------------------------------


# pdserve's variants: (dtype, quantization, kv_cache_dtype)
VARIANTS = {"float32": ("float32", "none", "auto"), "bfloat16": ("bfloat16", "none", "auto"),
            "bf16": ("float32", "bf16", "auto"), "bf16-kv16": ("float32", "bf16", "bfloat16"),
            "bf16-kv8": ("float32", "bf16", "int8"), "w8a8": ("float32", "w8a8_int8", "auto"),
            "w8a8-kv8": ("float32", "w8a8_int8", "int8")}


def pdserve_child(input_path: str, output_path: str, cpu_isa: str, variant: str, threads: int) -> None:
    dtype, quantization, kv_cache_dtype = VARIANTS[variant]
    started = time.time()
    t0 = time.perf_counter()
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(load_progress=False, cpu_isa=cpu_isa, dtype=dtype, num_threads=threads,
                                    quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                    enable_prefix_caching=False, max_model_len=4096))
    load_s = time.perf_counter() - t0
    ready_s = time.time() - _process_start(started)
    results = []
    for phase in json.loads(Path(input_path).read_text())["phases"]:
        for i, r in enumerate(phase["requests"]):
            engine.add_request(f"{phase['name']}-{i}", r["prompt_token_ids"],
                               SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]))
        outputs: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        wall = time.perf_counter() - t0
        reqs = [{"output_token_ids": outputs[f"{phase['name']}-{i}"]} for i in range(len(phase["requests"]))]
        results.append({"name": phase["name"], "wall_s": wall, "requests": reqs,
                        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in phase["requests"]),
                        "output_tokens": sum(len(r["output_token_ids"]) for r in reqs)})
    import torch

    cfg = engine.loaded.config
    Path(output_path).write_text(json.dumps({
        "import_s": import_s, "load_s": load_s, "ready_s": ready_s, "phases": results,
        "peak_rss_bytes": _peak_rss(), "cpu_plan": engine.cpu_plan.describe(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                                               "num_kv_heads", "head_dim", "vocab_size")}}))


def mfu_rows(args, out: Path, isa: str, raw: dict, rows: list[dict]) -> list[dict]:
    """The prefill's model FLOP utilisation (``prefill_flops`` at the prompt tok/s of each prefill row
    of this ISA mode) against the processor's matmul peak in the row's precision (float32 for the
    float32 rows, bfloat16 for the others), measured now in a child process under the same caps."""
    models = [r["model"] for k, r in raw.items() if k.startswith(f"pdserve/{isa}/") and "model" in r]
    prefills = [r for r in rows if r["workload"] == "prefill" and r["mode"].startswith(f"{isa} ")]
    if not models or not prefills:
        return []
    def precision(row: dict) -> str:  # ("native float32", "native bf16-kv16 (vLLM bfloat16)", ...)
        variant = row["mode"].split(" (")[0].split(" ")[-1]
        return "float32" if variant == "float32" else "int8" if variant.startswith("w8a8") else "bfloat16"

    peak_out = out / f"gemm_peak_{isa}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if isa == "avx2":
        from cpu_matmul import AVX2_ENV

        env.update(AVX2_ENV)
    wait_quiet(args.quiet_load, args.quiet_wait_s)
    subprocess.run([sys.executable, __file__, "--gemm-peak-child", str(peak_out), str(args.threads),
                    ",".join(sorted({precision(r) for r in prefills}))], env=env, check=True)
    peaks = json.loads(peak_out.read_text())
    raw[f"gemm_peak/{isa}"] = peaks
    tokens = next(ph["prompt_tokens"] for r in raw.values() if "phases" in r for ph in r["phases"]
                  if ph["name"].startswith("prefill/"))
    per_token = prefill_flops(models[0], tokens) / tokens
    print(f"{isa}: matmul peak, {args.threads} threads: "
          + ", ".join(f"{name} {peak / 1e9:.0f} GFLOP/s" for name, peak in peaks.items())
          + f"; the {tokens}-token prefill is {per_token * tokens / 1e9:.0f} GFLOP", flush=True)
    mfu = []
    for r in prefills:
        peak = peaks[precision(r)]
        mfu.append({**r, "workload": "prefill_mfu", "vllm": r["vllm"] and r["vllm"] * per_token / peak,
                    "pdserve": r["pdserve"] * per_token / peak})
    return mfu


def prefill_flops(model: dict, tokens: int) -> float:
    """The model's FLOPs for one prompt of ``tokens`` tokens and its one output token: every
    projection for each token, causal attention (scores and values over the pairs a causal mask
    keeps), the LM head for the last position only."""
    h, q, kv = model["hidden_size"], model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    per_token = 2 * model["num_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * model["intermediate_size"])
    attention = model["num_layers"] * 2 * 2 * q * tokens * (tokens + 1) / 2
    return per_token * tokens + attention + 2 * h * model["vocab_size"]


def gemm_peak_child(output_path: str, threads: int, dtypes: str) -> None:
    """The processor's matmul peak as torch reaches it with ``threads`` threads, in float32 (MKL),
    bfloat16 (oneDNN: AMX tiles or bf16 dot products where present) and int8 (w8a8's prefill products
    through the kernel it takes here: ``torch._int_mm``, oneDNN's VNNI or AMX int8 kernels, or oneDNN's
    qlinear with 7-bit weights on AVX2; ``formats.int8_matmuls``): the best over a few large
    shapes (m x n x k) of the median of 5 ``torch.mm`` calls after one, as the shape that suits the
    processor differs (on 2 AMX Xeon cores bfloat16 gave ~1.9 TFLOP/s at 4,096^3 and ~2.9 at
    2,048 x 4,096 x 1,024); run under the same ISA caps as the engines. ``dtypes``: comma-separated,
    those the rows need (bfloat16 under the AVX2 caps has no fast path: minutes a shape)."""
    import torch

    torch.set_num_threads(threads)
    peaks = {}
    for dtype in (getattr(torch, name) for name in dtypes.split(",")):
        best = 0.0
        for m, n, k in ((4096, 4096, 4096), (2048, 4096, 1024), (2048, 3072, 576)):
            if dtype == torch.int8:  # the kernel W8A8Linear takes here (torch's _int_mm is ~3 GOP/s without VNNI)
                from pdserve.engine.quant.formats import QLINEAR_WEIGHT_LEVELS, _qlinear, int8_matmuls

                kernel = int8_matmuls(torch.device("cpu"))
                a = torch.randint(-127, 128, (m, k), dtype=dtype)
                if kernel == "qlinear":
                    w = torch.randint(-QLINEAR_WEIGHT_LEVELS, QLINEAR_WEIGHT_LEVELS + 1, (n, k), dtype=dtype)
                    b = torch.ops.onednn.qlinear_prepack(w, None)
                    ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
                    mm = functools.partial(_qlinear, w_scale=ones, w_zero=zeros)
                elif kernel == "int_mm":
                    b, mm = torch.randint(-127, 128, (k, n), dtype=dtype), torch._int_mm
                else:
                    break
            else:
                a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
                mm = torch.mm
            mm(a, b)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                mm(a, b)
                times.append(time.perf_counter() - t0)
            best = max(best, 2 * m * n * k / statistics.median(times))
        peaks[str(dtype).removeprefix("torch.")] = best
    Path(output_path).write_text(json.dumps(peaks))


def _process_start(fallback: float) -> float:
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return fallback


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


# ---- the parent: quiet machine, runs, foreign load -------------------------------------------


def _busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # everything but idle and iowait


def wait_quiet(limit: float, wait_s: float) -> float:
    deadline = time.monotonic() + wait_s
    while (load := os.getloadavg()[0]) > limit and time.monotonic() < deadline:
        print(f"  waiting for a quiet machine (1-min load {load:.2f} > {limit})", file=sys.stderr, flush=True)
        time.sleep(15)
    return os.getloadavg()[0]


def _session_cpu(session: int, seen: dict[int, int]) -> None:
    """Record the CPU (user + system jiffies, its own only) of every process of ``session`` now."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; fields[0] is the state
        if int(fields[3]) == session:
            seen[int(entry.name)] = int(fields[11]) + int(fields[12])


def run_engine(cmd: list[str], output: Path, args, label: str, env: dict | None = None) -> dict:
    """Run one engine's child; its results, plus the load before and the foreign CPU during it.

    The engine's own CPU is that of every process in the child's session, sampled every half second
    (vLLM computes in a process, VLLM::Worker, that its parent does not wait for, so the children's
    times of ``os.times`` miss it and it would count as foreign)."""
    load = wait_quiet(args.quiet_load, args.quiet_wait_s)
    print(f"running {label} (1-min load {load:.2f}) ...", file=sys.stderr, flush=True)
    busy0, t0 = _busy_jiffies(), time.monotonic()
    log = output.with_suffix(".log")
    seen: dict[int, int] = {}
    with log.open("w") as sink:  # the engines' own logs, kept out of the table
        child = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=ROOT, stdout=sink, stderr=sink,
                                 start_new_session=True)
        while child.poll() is None:
            _session_cpu(child.pid, seen)
            time.sleep(0.5)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, cmd)
    wall = time.monotonic() - t0
    own = sum(seen.values()) / os.sysconf("SC_CLK_TCK")
    total = (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK")
    result = json.loads(output.read_text())
    result["load_before"] = load
    result["foreign_cores"] = max(0.0, (total - own) / wall)
    return result


def medians(result: dict) -> dict[str, float]:
    per: dict[str, list[float]] = {}
    for ph in result["phases"]:
        name = ph["name"].split("/")[0]
        if name == "warmup":
            continue
        tokens = ph["prompt_tokens"] if name == "prefill" else ph["output_tokens"]
        per.setdefault(name, []).append(tokens / ph["wall_s"])
    out = {k: statistics.median(v) for k, v in per.items()}
    out["ready_s"] = result["ready_s"]
    out["peak_rss_gb"] = result["peak_rss_bytes"] / 1e9
    return out


def agreement(a: dict, b: dict) -> tuple[int, int]:
    """Requests whose greedy outputs are token-identical, of those compared."""
    same = total = 0
    for pa, pb in zip(a["phases"], b["phases"]):
        for ra, rb in zip(pa["requests"], pb["requests"]):
            total += 1
            same += ra["output_token_ids"] == rb["output_token_ids"]
    return same, total


def table(rows: list[dict]) -> str:
    lines = ["| mode | workload | vllm-cpu | pdserve | pdserve / vllm | foreign load (vllm, pdserve) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        v, p = r["vllm"], r["pdserve"]
        ratio = f"{p / v:.2f}x" if v else "-"
        if r["workload"] in ("ready_s", "peak_rss_gb"):
            ratio = f"{v / p:.1f}x less" if v and p else "-"
        fmt = {"ready_s": "{:.1f}", "peak_rss_gb": "{:.1f}", "decode": "{:.1f}", "prefill_mfu": "{:.0%}"}.get(
            r["workload"], "{:.0f}")
        lines.append(f"| {r['mode']} | {r['workload']} | {fmt.format(v) if v else '-'} | {fmt.format(p)} | {ratio} | "
                     f"{r['foreign'][0]:.2f}, {r['foreign'][1]:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["workload"] in WORKLOADS and r["vllm"]]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(max(9, 1.3 * len(shown)), 4.5))
    labels = [f"{r['mode'].replace(' (', chr(10) + '(')}\n{r['workload']}" for r in shown]  # (vLLM's dtype: own line)
    ratios = [r["pdserve"] / r["vllm"] for r in shown]
    bars = ax.bar(range(len(shown)), ratios, color="tab:blue")
    ax.bar_label(bars, labels=[f"{x:.2f}x" for x in ratios], fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(shown)), labels, fontsize=6)
    ax.set_ylabel("pdserve / vllm-cpu (higher is better)")
    ax.set_title("Engine throughput against vLLM's CPU build, same token ids, 2 threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- serving: vllm serve and pdserve serve under vLLM's own client ------------------------------

SERVE_METRICS = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "p90_ttft_ms",
                 "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


SERVERS = {"vllm": "vllm serve", "vllm-bf16": "vllm serve --dtype bfloat16",
           "vllm-bf16-fp8kv": "vllm serve --dtype bfloat16 --kv-cache-dtype fp8", "colocated": "pdserve colocated",
           "colocated-bf16": "pdserve colocated, bf16 weights",
           "colocated-bf16-kv16": "pdserve colocated, bf16 weights and KV cache",
           "colocated-bf16-kv8": "pdserve colocated, bf16 weights, int8 KV cache",
           "colocated-p512": "pdserve colocated, --max-prefill-tokens 512", "1p1d": "pdserve 1 prefill + 1 decode",
           "1p1d-bf16-kv16": "pdserve 1 prefill + 1 decode, bf16 weights and KV cache",
           "1p1d-bf16-kv8": "pdserve 1 prefill + 1 decode, bf16 weights, int8 KV cache",
           "colocated-w8a8": "pdserve colocated, w8a8_int8",
           "colocated-w8a8-kv8": "pdserve colocated, w8a8_int8, int8 KV cache",
           "1p1d-w8a8-kv8": "pdserve 1 prefill + 1 decode, w8a8_int8, int8 KV cache"}


def serve_servers(args, port: int) -> dict[str, list[str]]:
    """The servers compared (those --serve-servers names), each a command listening on its own port
    (``port``, ``port + 1``, ...) under the checkpoint's path as its model name."""
    model = args.vllm_model
    names = args.serve_servers.split(",")
    ports = {name: port + i for i, name in enumerate(names)}

    def pd(name: str) -> list[str]:
        return [sys.executable, "-m", "pdserve.cluster.cli", "--log-level", "WARNING", "serve", "--launcher",
                "processes", "--port", str(ports[name]), "--served-model-name", model, "--no-enable-prefix-caching"]

    commands = {
        "vllm": lambda: [args.vllm_python, str(ROOT / "benchmarks" / "vllm_cpu.py"), "serve", model, "--dtype",
                         "float32", "--host", "127.0.0.1", "--port", str(ports["vllm"]), "--max-model-len", "4096",
                         "--no-enable-prefix-caching"],
        "vllm-bf16": lambda: [args.vllm_python, str(ROOT / "benchmarks" / "vllm_cpu.py"), "serve", model, "--dtype",
                              "bfloat16", "--host", "127.0.0.1", "--port", str(ports["vllm-bf16"]),
                              "--max-model-len", "4096", "--no-enable-prefix-caching"],
        "vllm-bf16-fp8kv": lambda: [args.vllm_python, str(ROOT / "benchmarks" / "vllm_cpu.py"), "serve", model,
                                    "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--host", "127.0.0.1", "--port",
                                    str(ports["vllm-bf16-fp8kv"]), "--max-model-len", "4096",
                                    "--no-enable-prefix-caching"],
        "colocated": lambda: [*pd("colocated"), "--prefill", "0", "--decode", "1"],
        "colocated-bf16": lambda: [*pd("colocated-bf16"), "--prefill", "0", "--decode", "1", "--quantization", "bf16"],
        "colocated-bf16-kv16": lambda: [*pd("colocated-bf16-kv16"), "--prefill", "0", "--decode", "1",
                                        "--quantization", "bf16", "--kv-cache-dtype", "bfloat16"],
        "colocated-bf16-kv8": lambda: [*pd("colocated-bf16-kv8"), "--prefill", "0", "--decode", "1",
                                       "--quantization", "bf16", "--kv-cache-dtype", "int8"],
        "colocated-p512": lambda: [*pd("colocated-p512"), "--prefill", "0", "--decode", "1",
                                   "--max-prefill-tokens", "512"],
        "1p1d": lambda: [*pd("1p1d"), "--prefill", "1", "--decode", "1"],
        "1p1d-bf16-kv16": lambda: [*pd("1p1d-bf16-kv16"), "--prefill", "1", "--decode", "1", "--quantization", "bf16",
                                   "--kv-cache-dtype", "bfloat16"],
        "1p1d-bf16-kv8": lambda: [*pd("1p1d-bf16-kv8"), "--prefill", "1", "--decode", "1", "--quantization", "bf16",
                                  "--kv-cache-dtype", "int8"],
        "colocated-w8a8": lambda: [*pd("colocated-w8a8"), "--prefill", "0", "--decode", "1",
                                   "--quantization", "w8a8_int8"],
        "colocated-w8a8-kv8": lambda: [*pd("colocated-w8a8-kv8"), "--prefill", "0", "--decode", "1",
                                       "--quantization", "w8a8_int8", "--kv-cache-dtype", "int8"],
        "1p1d-w8a8-kv8": lambda: [*pd("1p1d-w8a8-kv8"), "--prefill", "1", "--decode", "1", "--quantization",
                                  "w8a8_int8", "--kv-cache-dtype", "int8"],
    }
    return {SERVERS[name]: (ports[name], commands[name]()) for name in names}


def bench_serve(args, port: int, rate: float, out: Path, server: str) -> dict:
    """One `vllm bench serve` run at ``rate`` against ``server`` on ``port``; its result JSON (kept
    per server and rate in ``out``)."""
    name = f"serve_{''.join(c if c.isalnum() else '_' for c in server)}_{rate:g}.json"
    cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_cpu.py"), "bench", "serve", "--backend", "openai",
           "--endpoint", "/v1/completions", "--model", args.vllm_model, "--tokenizer", args.vllm_model,
           "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "random", "--random-input-len",
           str(args.serve_input), "--random-output-len", str(args.serve_output), "--num-prompts",
           str(args.serve_prompts), "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--seed", "0",
           "--save-result", "--result-dir", str(out), "--result-filename", name]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / name).read_text())


def machine_busy(seconds: float = 2.0) -> float:
    """Cores the whole machine kept busy over the next ``seconds``."""
    busy0, t0 = _busy_jiffies(), time.monotonic()
    time.sleep(seconds)
    return (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)


def wait_idle(limit: float, wait_s: float) -> float:
    """Wait (up to ``wait_s``) until the machine keeps fewer than ``limit`` cores busy over 2 s: the
    servers up and idle, the last run's stragglers done. Returns the last reading."""
    deadline = time.monotonic() + wait_s
    while (busy := machine_busy()) > limit and time.monotonic() < deadline:
        print(f"  waiting for an idle machine ({busy:.2f} cores busy > {limit})", file=sys.stderr, flush=True)
    return busy


def serve_comparison(args, out: Path) -> list[dict]:
    """Each server alone on the machine, one after the other: started, run at every rate, stopped.
    (Before, every server was up at once, each rate run against each in turn, so that a slower hour
    of a shared machine would land on all alike; but an idle vllm serve beside it slowed pdserve's
    runs: on 2 AMX Xeon cores, bf16 weights and KV cache, at 5 req/s p90 TTFT 828 ms and p90 TPOT 95
    against 535 and 86 alone, while vLLM's figures were the same either way. Its idle processes
    woke now and then, and pdserve's steps, with hundreds of parallel regions each, wait at every
    region for a thread that was preempted.)"""
    servers = serve_servers(args, args.serve_port)
    rows = []
    for server, (port, cmd) in servers.items():
        wait_quiet(args.quiet_load, args.quiet_wait_s)
        print(f"starting {server} on port {port} ...", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", proc, 900)
            if "pdserve" in server:
                _wait_http(f"http://127.0.0.1:{port}/ready", proc, 300)
            for rate in [float(r) for r in args.serve_rates.split(",")]:
                idle = wait_idle(args.idle_cores, 120)
                busy0, t0 = _busy_jiffies(), time.monotonic()
                result = bench_serve(args, port, rate, out, server)
                load = (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
                rows.append({"server": server, "rate": rate, "cores_busy": load, "idle_before": idle,
                             **{k: result.get(k) for k in SERVE_METRICS}})
                print(serve_table(rows[-1:]), file=sys.stderr, flush=True)
        finally:
            _stop(proc)
    return rows


def serve_table(rows: list[dict]) -> str:
    lines = ["| rate | server | ok / failed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | "
             "TPOT p50 / p90 / p99 (ms) | cores busy |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['server']} | {r['completed']} / {r['failed']} | "
                     f"{r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.0f} | "
                     f"{r['median_ttft_ms']:.0f} / {r['p90_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.0f} / {r['p90_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | "
                     f"{r['cores_busy']:.2f} |")
    return "\n".join(lines)


def goodput(rows: list[dict], ttft_ms: float, tpot_ms: float) -> dict[str, float]:
    """Per server, the highest rate whose p90 TTFT and TPOT meet the SLO with every request served
    (0: none does; a run with failed requests never meets it, whatever its latencies)."""
    best: dict[str, float] = {}
    for r in rows:
        best.setdefault(r["server"], 0.0)
        if r["failed"] == 0 and r["completed"] > 0 and r["p90_ttft_ms"] <= ttft_ms and r["p90_tpot_ms"] <= tpot_ms:
            best[r["server"]] = max(best[r["server"]], r["rate"])
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None,
                        help="the python of vLLM's venv (benchmarks/setup_vllm_cpu.sh builds .vllm-venv); "
                             "without it only pdserve runs")
    parser.add_argument("--vllm-model", default=str(ROOT / ".vllm-venv" / "smollm2-135m-instruct-hf"),
                        help="vLLM's checkpoint: the float32 export of the same GGUF (setup_vllm_cpu.sh makes it)")
    parser.add_argument("--vllm-dtype", default="float32",
                        help="comma-separated vLLM --dtype runs offline: float32, bfloat16; pdserve's bf16 and "
                             "bfloat16 variants are set beside vLLM's bfloat16 run when there is one (default: "
                             "float32)")
    parser.add_argument("--isa", default="native", help="comma-separated: native, avx2 (default: native)")
    parser.add_argument("--pdserve", default="float32",
                        help="comma-separated pdserve variants: float32, bfloat16 (--dtype bfloat16: weights, "
                             "activations and KV cache), bf16 (--quantization bf16: bfloat16 weights in a float32 "
                             "model), bf16-kv16 (bf16 with --kv-cache-dtype bfloat16), bf16-kv8 (bf16 with "
                             "--kv-cache-dtype int8), w8a8 (--quantization w8a8_int8: int8 weights, prefill "
                             "activations int8 per token), w8a8-kv8 (w8a8 with --kv-cache-dtype int8); all but "
                             "float32 are set beside vLLM's bfloat16 run when there is one (default: float32)")
    parser.add_argument("--threads", type=int, default=2, help="threads per engine (default: 2)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each workload (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="prompt ids seed (default: 0)")
    parser.add_argument("--quiet-load", type=float, default=0.5, help="wait until the 1-min load is under this")
    parser.add_argument("--quiet-wait-s", type=float, default=600, help="wait at most this long for it")
    parser.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go")
    parser.add_argument("--serve", action="store_true",
                        help="also compare serving: vllm serve, pdserve serve colocated and 1 prefill + 1 decode, "
                             "each alone on the machine in turn, driven by `vllm bench serve` (random prompts) at "
                             "each of --serve-rates")
    parser.add_argument("--serve-servers", default="vllm,colocated,1p1d",
                        help="comma-separated servers for --serve: "
                             + ", ".join(f"{k} ({v})" for k, v in SERVERS.items()) + " (default: vllm,colocated,1p1d)")
    parser.add_argument("--serve-rates", default="1,2", help="request rates, comma-separated (default: 1,2)")
    parser.add_argument("--serve-prompts", type=int, default=40, help="prompts per rate (default: 40)")
    parser.add_argument("--serve-input", type=int, default=512, help="prompt tokens (default: 512)")
    parser.add_argument("--serve-output", type=int, default=128, help="output tokens (default: 128)")
    parser.add_argument("--serve-port", type=int, default=18123,
                        help="port of the first server; the others listen on the next ones (default: 18123)")
    parser.add_argument("--idle-cores", type=float, default=0.3,
                        help="--serve: before each run, wait until the machine keeps fewer cores busy (default: 0.3)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000, help="goodput SLO: p90 TTFT (default: 1000)")
    parser.add_argument("--slo-tpot-ms", type=float, default=100, help="goodput SLO: p90 TPOT (default: 100)")
    parser.add_argument("--skip-offline", action="store_true", help="only the serving comparison")
    parser.add_argument("--pdserve-child", nargs=5, metavar=("INPUT", "OUTPUT", "ISA", "DTYPE", "THREADS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--gemm-peak-child", nargs=3, metavar=("OUTPUT", "THREADS", "DTYPES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pdserve_child:
        i, o, isa, dtype, threads = args.pdserve_child
        pdserve_child(i, o, isa, dtype, int(threads))
        return 0
    if args.gemm_peak_child:
        gemm_peak_child(args.gemm_peak_child[0], int(args.gemm_peak_child[1]), args.gemm_peak_child[2])
        return 0
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.serve:
        unknown = set(args.serve_servers.split(",")) - set(SERVERS)
        if unknown:
            parser.error(f"--serve-servers: unknown {', '.join(sorted(unknown))}; known: {', '.join(SERVERS)}")
        if not args.vllm_python:
            parser.error("--serve needs --vllm-python (its client is vllm bench serve)")
        rows = serve_comparison(args, out)
        print(f"\nCPU: {describe_cpu()}\n\n{serve_table(rows)}")
        best = goodput(rows, args.slo_ttft_ms, args.slo_tpot_ms)
        print(f"\ngoodput (highest rate with p90 TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms): "
              + ", ".join(f"{k}: {v:g} req/s" for k, v in best.items()))
        (out / "serve_vs_vllm.json").write_text(json.dumps({"cpu": describe_cpu(), "rows": rows,
                                                           "goodput": best}, indent=1))
        if args.skip_offline:
            return 0
    workload = out / "engine_vs_vllm_requests.json"
    workload.write_text(json.dumps({"phases": phases(args.reps, args.seed)}))
    rows, raw = [], {}
    for isa in args.isa.split(","):
        vllms = {}
        for vdtype in args.vllm_dtype.split(",") if args.vllm_python else ():
            suffix = "" if vdtype == "float32" else f"_{vdtype}"
            vout = out / f"engine_vs_vllm_vllm_{isa}{suffix}.json"
            cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_cpu.py"), "--isa", isa, "offline", "--model",
                   args.vllm_model, "--input", str(workload), "--output", str(vout), "--max-model-len", "4096",
                   "--dtype", vdtype]
            key = f"vllm/{isa}" if vdtype == "float32" else f"vllm/{isa}/{vdtype}"
            vllms[vdtype] = raw[key] = run_engine(cmd, vout, args, f"vllm-cpu ({isa}, {vdtype})")
        for dtype in args.pdserve.split(","):
            # Each pdserve variant beside the vLLM run of its precision when there is one: float32 with
            # float32, bfloat16 weights (bf16, bfloat16) with vLLM's bfloat16.
            vdtype = "bfloat16" if dtype != "float32" and "bfloat16" in vllms else "float32"
            vllm = vllms.get(vdtype)
            pout = out / f"engine_vs_vllm_pdserve_{isa}_{dtype}.json"
            cpu_isa = "auto" if isa == "native" else isa
            cmd = [sys.executable, __file__, "--pdserve-child", str(workload), str(pout), cpu_isa, dtype,
                   str(args.threads)]
            env = {"OMP_NUM_THREADS": str(args.threads)}
            ours = raw[f"pdserve/{isa}/{dtype}"] = run_engine(cmd, pout, args, f"pdserve ({isa}, {dtype})", env)
            theirs = medians(vllm) if vllm else {}
            for name, value in medians(ours).items():
                mode = f"{isa} {dtype}" if not vllm or vdtype == "float32" else f"{isa} {dtype} (vLLM {vdtype})"
                rows.append({"mode": mode, "workload": name, "vllm": theirs.get(name), "pdserve": value,
                             "foreign": (vllm["foreign_cores"] if vllm else 0.0, ours["foreign_cores"])})
            if vllm and dtype == "float32":
                same, total = agreement(vllm, ours)
                print(f"{isa}: greedy outputs token-identical in {same} of {total} requests", flush=True)
        rows += mfu_rows(args, out, isa, raw, rows)
    print(f"\nCPU: {describe_cpu()}\n")
    print(table(rows))
    (out / "engine_vs_vllm.json").write_text(json.dumps({"cpu": describe_cpu(), "rows": rows, "raw": raw},
                                                        indent=1))
    plot(rows, out / "engine_vs_vllm.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
