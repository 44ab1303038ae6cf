"""Choices of the CPU paths that the processor's flags do not settle: measured on the machine,
once, and kept in the cache directory so that every process on it chooses alike.

``kept(name, key, measure)`` is the mechanism: the first process to need a choice on a machine
runs ``measure`` under a lock and writes the answer to ``$PDSERVE_CACHE_DIR/measured.json``
under ``key`` (what the answer depends on: the processor, the ISA, the threads, torch's version,
the shapes); every later process reads it. Paths that round differently must not differ between
workers that exchange KV or whose outputs are compared, and processes that start together wait
for one measurement. A cache that cannot be read or written is measured around, for that
process only. A measurement taken while other processes kept more than ``BUSY_CORES`` of the
machine busy is the load's as much as the processor's (a 2-core Xeon whose quiet measurement says
12 rows had kept 1, most likely measured beside a loaded test run, and served every later process
with it: decode steps of 2-10 requests 1.6-2.4x slower): it is kept as provisional, with the load, for
``PROVISIONAL_S``: the workers starting with it still agree, and the first process to start after
that measures again.

Five choices use it:

- **the few-rows threshold** (``few_rows_for``): up to how many rows a float32 projection (and,
  measured apart, a bfloat16 one: ``quant.formats.BF16Linear``, 8 on the AMX Xeon) goes
  through the C kernel, which reads each row of W once for all the rows, rather than the
  ``linear_path`` (oneDNN with packed weights, or MKL). Where the path overtakes is the
  processor's: on a 2-core Zen 4 with AVX-512 oneDNN was as fast from 4 rows, on Zen 3 (AVX2) the
  C kernel led up to 8, and on a 2-core AMX Xeon up to 12 (a decode step of 8 requests 48 ms
  against 63; ``benchmarks/decode_steps.py --few-rows N``). Timed on one decoder layer's
  projections both ways at each of ``CANDIDATES`` rows.
- **a bf16 model's prefill products** (``attention.CpuPagedAttention.choose_prefill_products``).
- **a bf16 projection's rows on AMX tiles** (``amx_rows_for``): up to how many rows each shape of
  a layer's ``BF16Linear`` projections goes through our AMX kernel rather than oneDNN. On 2 AMX Xeon
  cores oneDNN ran some shapes at some row counts on one core (SmolLM2's o and down projections at
  384-768 rows, its qkv at 768-1,024: no faster than on one thread), our kernel at ~2.1-2.4 TFLOP/s
  throughout; oneDNN led on the 3,072-wide gate_up and from ~1,536 rows (up to 2.9).
- **a bf16 projection's rows through bf16 dot products** (``dp_rows_for``): where there are no AMX tiles, up
  to how many rows each shape goes through our vdpbf16ps kernel (``cpu_kernels.dp_gemm``) rather than oneDNN,
  past the ``BF16Linear.DP_ROWS`` it always takes. On
  2 Zen 4 cores it streams SmolLM2's weights at ~29 GB/s at one row and ~24 at 8 (oneDNN: ~18), and stays level
  with oneDNN's bf16 matmul (within 4%) up to 512 rows.
- **a bf16 MLP's SwiGLU in the AMX kernel's stores** (``swiglu_rows_for``): up to how many rows
  gate_up and SwiGLU are one pass over the tiles, rather than the product (on its path above) and
  then ``silu_mul``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from pdserve.engine.cpu_kernels import cache_root

log = logging.getLogger(__name__)
T = TypeVar("T")

CANDIDATES = (2, 4, 8, 12, 16, 24)
ROUNDS = 20  # every candidate both ways once a round, the best of the rounds kept
BUSY_CORES = 0.3  # other processes' load during a measurement above which its answer is provisional
PROVISIONAL_S = 600.0  # how long a provisional answer serves the processes that start


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(layer: list, candidates: tuple[int, ...] = CANDIDATES) -> tuple[int, dict[int, tuple[float, float]]]:
    """``(rows, seconds)``: the largest candidate up to which the C kernel is at least as fast as the
    path at every candidate (1: from 2 rows the path wins), and each candidate's (C, path) seconds
    for all of ``layer``'s projections (``model.Linear``s or ``BF16Linear``s with their kernels set:
    ``c_rows`` against ``many_rows``): the best of ``ROUNDS`` rounds, each timing every candidate
    both ways, so that a pause of the process lands on one round rather than on one candidate."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        calls = {}
        for rows in candidates:
            xs = [torch.randn(rows, m.in_features, generator=gen) for m in layer]
            calls[rows] = (lambda xs=xs: [m.c_rows(x) for m, x in zip(layer, xs)],
                           lambda xs=xs: [m.many_rows(x) for m, x in zip(layer, xs)])
            calls[rows][1]()  # oneDNN builds its kernel for the shape on the first call
        seconds = {rows: (float("inf"), float("inf")) for rows in candidates}
        for _ in range(ROUNDS):
            for rows, (c, path) in calls.items():
                best_c, best_path = seconds[rows]
                seconds[rows] = (min(best_c, _timed(c)), min(best_path, _timed(path)))
    best = 1
    for rows in candidates:
        if seconds[rows][0] > seconds[rows][1]:
            break
        best = rows
    return best, seconds


def _busy_seconds() -> float | None:
    """CPU seconds every process of the machine has spent so far (/proc/stat), None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def others_load(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``, and how many cores other processes kept busy meanwhile on average (0.0 where the
    machine does not say)."""
    busy, own, start = _busy_seconds(), sum(os.times()[:2]), time.monotonic()
    result = fn()
    wall, busy_after = time.monotonic() - start, _busy_seconds()
    if busy is None or busy_after is None or wall <= 0:
        return result, 0.0
    return result, max(0.0, (busy_after - busy) - (sum(os.times()[:2]) - own)) / wall


def kept(name: str, key: str, measure: Callable[[], tuple[object, str]]) -> object:
    """The answer to ``name`` for ``key`` on this machine: read from the cache directory, or
    ``measure()``'d (it returns the answer and a line for the log) and written there, under a lock."""
    path = cache_root() / "measured.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            known = json.loads(path.read_text()) if path.exists() else {}
            entry = known.get(f"{name} | {key}")
            if entry is not None and not (isinstance(entry, dict) and time.time() - entry["at"] > PROVISIONAL_S):
                answer = entry["answer"] if isinstance(entry, dict) else entry
                log.info("%s: %s (measured on this machine before%s: %s)", name, answer,
                         ", under load, provisionally" if isinstance(entry, dict) else "", path)
                return answer
            (answer, detail), others = others_load(measure)
            if others > BUSY_CORES:  # provisional: see the module
                log.warning("%s: %s, measured while other processes kept %.1f cores busy (%s): kept in %s for "
                            "%.0f s only", name, answer, others, detail, path, PROVISIONAL_S)
                known[f"{name} | {key}"] = {"answer": answer, "busy_cores": round(others, 2), "at": time.time()}
            else:
                known[f"{name} | {key}"] = answer
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
    except (OSError, ValueError) as e:  # a read-only or broken cache: measure, keep nothing
        log.warning("cannot keep %s in %s (%s): measuring it for this process only", name, path, e)
        answer, detail = measure()
    log.info("%s: %s, measured on this machine (%s); kept in %s", name, answer, detail, path)
    return answer


def machine_key(*parts) -> str:
    """What a measured answer depends on: the processor, the ISA, torch's version, and ``parts``."""
    from pdserve.engine.cpu_isa import active_isa, describe_cpu

    return " | ".join([describe_cpu(), active_isa(), f"torch {torch.__version__}", *map(str, parts)])


def few_rows_for(layer: list, threads: int) -> int:
    """The row threshold for projections like ``layer``'s on this machine (``kept``, ``measure``)."""
    def timed() -> tuple[int, str]:
        rows, seconds = measure(layer)
        return rows, (f"one layer, C against {layer[0].path}, ms: "
                      + ", ".join(f"{r} rows {c * 1e3:.2f}/{p * 1e3:.2f}" for r, (c, p) in seconds.items()))

    shapes = sorted((m.out_features, m.in_features) for m in layer)
    build = Path(layer[0].kernels._name).stem  # the kernels' build (their sources' hash): a new kernel measures anew
    return kept(f"largest batch of rows through the C kernels (more: {layer[0].path})",
                machine_key(layer[0].path, f"{threads} threads", shapes, build), timed)


DP_CANDIDATES = (64, 128, 256, 512)  # (fewer rows: the dot products, BF16Linear.DP_ROWS)
AMX_CANDIDATES = (128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
SWIGLU_CANDIDATES = (32, 64, 128, 256, 512, 1024, 2048)
AMX_ROUNDS = 5


def _race(make: Callable[[int], tuple[Callable, Callable]], candidates: tuple[int, ...]) -> dict:
    """Each candidate's (ours, theirs) seconds, ``make(rows)`` giving the two calls: the best of
    ``AMX_ROUNDS`` rounds, each timing every candidate both ways (the first call of each, which builds
    oneDNN's kernel for the shape, untimed)."""
    with torch.inference_mode():
        calls = {rows: make(rows) for rows in candidates}
        for ours, theirs in calls.values():
            ours(), theirs()
        seconds = {rows: (float("inf"), float("inf")) for rows in candidates}
        for _ in range(AMX_ROUNDS):
            for rows, (ours, theirs) in calls.items():
                best_ours, best_theirs = seconds[rows]
                seconds[rows] = (min(best_ours, _timed(ours)), min(best_theirs, _timed(theirs)))
    return seconds


def least_time_limit(seconds: dict[int, tuple[float, float]]) -> int:
    """The row limit whose choice, ours up to it and theirs past it, takes the least time over the
    candidates, each counted as its time over theirs (each row count weighs alike: a 128-row step is
    as common as a 2,048-row one); 0: theirs throughout. Ties go to the lower limit."""
    cost = {0: float(len(seconds))}
    for limit in seconds:
        cost[limit] = sum(a / b if rows <= limit else 1.0 for rows, (a, b) in seconds.items())
    return min(cost, key=lambda limit: (cost[limit], limit))


def measure_amx_rows(module, candidates: tuple[int, ...] = AMX_CANDIDATES) -> tuple[int, dict]:
    """``(rows, seconds)`` for one ``BF16Linear`` with AMX tiles: up to how many rows (0: none past
    the decode kernel's) its AMX kernel should take (``least_time_limit``), and each candidate's
    (AMX, oneDNN) seconds."""
    from pdserve.engine.cpu_kernels import amx_gemm
    from pdserve.engine.model import onednn_linear

    gen = torch.Generator().manual_seed(0)

    def make(rows: int) -> tuple[Callable, Callable]:
        x = torch.randn(rows, module.in_features, generator=gen).to(torch.bfloat16)
        return (lambda: amx_gemm(module.kernels, module.amx, module.out_features, x, torch.bfloat16),
                lambda: onednn_linear(x, module.packed, module.padded_rows))

    seconds = _race(make, candidates)
    return least_time_limit(seconds), seconds


def measure_dp_rows(module, candidates: tuple[int, ...] = DP_CANDIDATES) -> tuple[int, dict]:
    """``(rows, seconds)`` for one ``BF16Linear`` with a weight packed for bf16 dot products: up to how many rows
    (0: none) our kernel should take (``least_time_limit``), and each candidate's (ours, oneDNN) seconds."""
    from pdserve.engine.cpu_kernels import dp_gemm
    from pdserve.engine.model import onednn_linear

    gen = torch.Generator().manual_seed(0)

    def make(rows: int) -> tuple[Callable, Callable]:
        x = torch.randn(rows, module.in_features, generator=gen).to(torch.bfloat16)
        return (lambda: dp_gemm(module.kernels, module.dp, module.out_features, x, torch.bfloat16),
                lambda: onednn_linear(x, module.packed, module.padded_rows))

    seconds = _race(make, candidates)
    return least_time_limit(seconds), seconds


def measure_swiglu_rows(gate_up, candidates: tuple[int, ...] = SWIGLU_CANDIDATES) -> tuple[int, dict]:
    """``(rows, seconds)`` for a bf16 MLP's fused gate_up (a ``BF16Linear`` with AMX tiles): up to how
    many rows SwiGLU goes in the tile kernel's stores (``amx_swiglu``) rather than after the product
    (``product_bf16`` on its measured path, then ``silu_mul``), and each candidate's (fused, apart)
    seconds."""
    from pdserve.engine.cpu_kernels import amx_swiglu, silu_mul

    gen = torch.Generator().manual_seed(0)
    lib = gate_up.kernels

    def make(rows: int) -> tuple[Callable, Callable]:
        x = torch.randn(rows, gate_up.in_features, generator=gen).to(torch.bfloat16)
        return (lambda: amx_swiglu(lib, gate_up.amx, gate_up.out_features, x),
                lambda: silu_mul(lib, gate_up.product_bf16(x)))

    seconds = _race(make, candidates)
    return least_time_limit(seconds), seconds


def _kept_rows(what: str, measure: Callable[..., tuple[int, dict]], candidates: tuple[int, ...], module,
               threads: int) -> int:
    def timed() -> tuple[int, str]:
        rows, seconds = measure(module, candidates)
        return rows, (f"{module.out_features} x {module.in_features}, ours against theirs, ms: "
                      + ", ".join(f"{r} rows {a * 1e3:.3f}/{b * 1e3:.3f}" for r, (a, b) in seconds.items()))

    build = Path(module.kernels._name).stem
    shape = (module.out_features, module.in_features)
    return kept(what, machine_key(f"{threads} threads", shape, f"rows {list(candidates)}", build), timed)


def amx_rows_for(module, threads: int) -> int:
    """Up to how many rows ``module``'s shape goes through the AMX kernels on this machine (``kept``,
    ``measure_amx_rows``); 0: past the decode kernel's rows, oneDNN."""
    return _kept_rows("most rows of a bf16 projection on AMX tiles (more: oneDNN)",
                      measure_amx_rows, AMX_CANDIDATES, module, threads)


def dp_rows_for(module, threads: int) -> int:
    """Up to how many rows ``module``'s shape goes through bf16 dot products on this machine (``kept``,
    ``measure_dp_rows``); 0: oneDNN throughout."""
    return _kept_rows("most rows of a bf16 projection through bf16 dot products (more: oneDNN)",
                      measure_dp_rows, DP_CANDIDATES, module, threads)


def swiglu_rows_for(gate_up, threads: int) -> int:
    """Up to how many rows a bf16 MLP of ``gate_up``'s shape applies SwiGLU in the AMX kernel's stores
    on this machine (``kept``, ``measure_swiglu_rows``); 0: never."""
    return _kept_rows("most rows of a bf16 MLP's SwiGLU fused into its AMX gate_up (more: apart)",
                      measure_swiglu_rows, SWIGLU_CANDIDATES, gate_up, threads)
