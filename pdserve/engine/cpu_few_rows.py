"""Up to how many rows a float32 projection goes through the C kernel (``Linear.few_rows``),
measured on this processor rather than assumed from its flags.

The C kernel reads each row of W once for all the rows (decode of a few requests); past some row
count the ``linear_path`` (oneDNN with packed weights, or MKL) is faster. Where that happens is the
processor's: on a 2-core Zen 4 with AVX-512 oneDNN was as fast from 4 rows, on Zen 3 (AVX2) the C
kernel led up to 8, and on a 2-core AMX Xeon it led up to 12 (a decode step of 8 requests 48 ms
against 63; ``benchmarks/decode_steps.py --few-rows N``). So the first model to load on a machine
times one decoder layer's projections both ways at each of ``CANDIDATES`` rows and keeps the
answer in the cache directory, keyed by the processor, the ISA, the path, the threads and the
shapes. Every later process on the machine reads it: the two paths round differently in the last
bits, and workers that exchange KV or whose outputs are compared must multiply alike. A lock
makes processes that start together wait for one measurement.

    rows = few_rows_for(layer_projections, threads)   # cached after the first time on this machine
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time

import torch

from pdserve.engine.cpu_kernels import cache_root

log = logging.getLogger(__name__)

CANDIDATES = (2, 4, 8, 12, 16, 24)


def _best_of(fn, runs: int = 5) -> float:
    fn()  # oneDNN builds its kernel for the shape on the first call
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def measure(layer: list, candidates: tuple[int, ...] = CANDIDATES) -> tuple[int, dict[int, tuple[float, float]]]:
    """``(rows, seconds)``: the largest candidate up to which the C kernel is at least as fast as the
    path at every candidate (1: from 2 rows the path wins), and each candidate's (C, path) seconds
    for all of ``layer``'s projections (``model.Linear``s with their kernels set)."""
    from pdserve.engine import cpu_kernels

    gen = torch.Generator().manual_seed(0)
    seconds = {}
    with torch.inference_mode():
        for rows in candidates:
            xs = [torch.randn(rows, m.weight.shape[1], generator=gen) for m in layer]
            c = _best_of(lambda xs=xs: [cpu_kernels.gemm_rows(m.kernels, m.weight, x) for m, x in zip(layer, xs)])
            path = _best_of(lambda xs=xs: [m.many_rows(x) for m, x in zip(layer, xs)])
            seconds[rows] = (c, path)
    best = 1
    for rows in candidates:
        if seconds[rows][0] > seconds[rows][1]:
            break
        best = rows
    return best, seconds


def few_rows_for(layer: list, threads: int) -> int:
    """The row threshold for projections like ``layer``'s on this machine: read from the cache
    directory, or measured (``measure``) and written there, under a lock."""
    from pdserve.engine.cpu_isa import active_isa, describe_cpu

    shapes = sorted(tuple(m.weight.shape) for m in layer)
    key = " | ".join([describe_cpu(), active_isa(), layer[0].path, f"{threads} threads", f"torch {torch.__version__}",
                      str(shapes)])
    path = cache_root() / "few_rows.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            known = json.loads(path.read_text()) if path.exists() else {}
            if key in known:
                log.info("projections of 1-%d rows through the C kernels, more through %s (measured on this "
                         "processor before: %s)", known[key], layer[0].path, path)
                return known[key]
            rows, seconds = measure(layer)
            known[key] = rows
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
    except (OSError, ValueError) as e:  # a read-only or broken cache: measure, keep nothing
        log.warning("cannot keep the row threshold in %s (%s): measuring it for this process only", path, e)
        rows, seconds = measure(layer)
    log.info("projections of 1-%d rows through the C kernels, more through %s: measured on this processor "
             "(one layer, C against %s, ms: %s); kept in %s", rows, layer[0].path, layer[0].path,
             ", ".join(f"{r} rows {c * 1e3:.2f}/{p * 1e3:.2f}" for r, (c, p) in seconds.items()), path)
    return rows
