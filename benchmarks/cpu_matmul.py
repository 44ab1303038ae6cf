"""The engine's matmul paths on this processor: GFLOP/s of every candidate for each projection shape
of the default model and each batch size, natively and with AVX-512 switched off (AVX2 figures on
an AVX-512 machine). This is the measurement behind the engine's run-time choice (engine/cpu_isa.py).

    python benchmarks/cpu_matmul.py                  # both ISA modes, ~2 minutes
    python benchmarks/cpu_matmul.py --isa native     # one mode

Candidates for ``y = x W^T`` (W ``[n, k]``, x ``[m, k]``), 2 threads, float32 unless named:
  mkl         torch's F.linear (MKL's SGEMM on x86)
  split       W split in one half per thread, one single-threaded GEMM each (bmm)
  onednn      oneDNN with W packed once at load (torch.ops.mkldnn._linear_pointwise)
  c_rows      the engine's C kernel for a few rows (reads W once): m <= 8 only
  bf16        F.linear in bfloat16 (oneDNN; avx512_bf16 where present)
  onednn_bf16 oneDNN with a packed bfloat16 W
Each figure is the median of repeated calls; every mode runs in its own process (the ISA caps
are read when oneDNN, MKL and ATen start). Prints the table with the processor's flags and the
best path per cell; writes JSON to --result-dir.
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

from pdserve.engine.cpu_isa import describe_cpu

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = [1, 4, 8, 32, 128, 512, 2048]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "PDSERVE_CPU_ISA": "avx2"}


def measure(args) -> dict:
    """In the child: every candidate on every shape and row count."""
    import torch

    from pdserve.engine import cpu_kernels

    torch.set_num_threads(args.threads)
    lib = cpu_kernels.load_kernels()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def median(fn) -> float:
        fn()
        fn()
        times = []
        deadline = time.perf_counter() + args.seconds
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out = {"capability": torch.backends.cpu.get_cpu_capability(), "bf16": bf16, "cells": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        wb = w.bfloat16()
        packed_b = torch.ops.mkldnn._reorder_linear_weight(wb, None) if bf16 else None
        halves = w.view(args.threads, n // args.threads, k).transpose(1, 2)
        for m in ROWS:
            x = torch.randn(m, k)
            cands = candidates(x, w, packed, wb, packed_b, halves, lib, args.threads)
            flops = 2 * m * n * k
            gflops = {c: flops / median(fn) / 1e9 for c, fn in cands.items()}
            out["cells"].append({"shape": name, "n": n, "k": k, "m": m, "gflops": gflops})
            print(f"  {name:8s} m={m:5d} " + " ".join(f"{c}={g:6.1f}" for c, g in gflops.items()), file=sys.stderr,
                  flush=True)
    return out


def candidates(x, w, packed, wb, packed_b, halves, lib, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from pdserve.engine import cpu_kernels

    m, k = x.shape
    xb = x.bfloat16()
    cands = {
        "mkl": lambda: F.linear(x, w),
        "split": lambda: torch.bmm(x.expand(threads, m, k), halves),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "bf16": lambda: F.linear(xb, wb),
    }
    if packed_b is not None:
        cands["onednn_bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, packed_b, None, "none", [], "")
    if lib is not None and m <= 8:
        cands["c_rows"] = lambda: cpu_kernels.gemm_rows(lib, w, x)
    return cands


def table(mode: str, result: dict) -> str:
    cols = ["mkl", "split", "onednn", "c_rows", "bf16", "onednn_bf16"]
    lines = [f"\n{mode}: ATen capability {result['capability']}, oneDNN bf16 {result['bf16']} (GFLOP/s, 2 threads)",
             "| shape | m | " + " | ".join(cols) + " | best fp32 | best |", "|" + "---|" * (len(cols) + 4)]
    for cell in result["cells"]:
        g = cell["gflops"]
        fp32 = {c: v for c, v in g.items() if "bf16" not in c}
        row = " | ".join(f"{g[c]:.0f}" if c in g else "-" for c in cols)
        lines.append(f"| {cell['shape']} | {cell['m']} | {row} | {max(fp32, key=fp32.get)} | {max(g, key=g.get)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", choices=["both", "native", "avx2"], default="both",
                        help="which modes to measure (avx2: AVX-512 capped off in oneDNN, MKL, ATen, the C kernels)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--seconds", type=float, default=0.3, help="time spent on each cell (default: 0.3)")
    parser.add_argument("--result-dir", default="bench-results", help="where the JSON goes (default: bench-results)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    modes = ["native", "avx2"] if args.isa == "both" else [args.isa]
    results = {}
    for mode in modes:
        env = {**os.environ, **(AVX2_ENV if mode == "avx2" else {})}
        print(f"measuring {mode} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads), "--seconds",
                               str(args.seconds)], env=env, stdout=subprocess.PIPE, text=True, check=True)
        results[mode] = json.loads(proc.stdout)
    print(f"CPU: {describe_cpu()}")
    for mode, result in results.items():
        print(table(mode, result))
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_matmul.json").write_text(json.dumps({"cpu": describe_cpu(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
