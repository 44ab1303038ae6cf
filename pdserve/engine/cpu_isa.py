"""Which instruction set the engine computes with on this CPU, chosen once at start-up.

    plan = select_isa(config.cpu_isa)     # "auto" reads the processor; or a cap ("avx2", ...)
    plan.apply_env()                      # oneDNN, MKL, ATen and the C kernels keep to plan.isa
    log.info(plan.describe())             # the choice and why, once

The processor's own flags decide (``/proc/cpuinfo``): ``amx`` (AMX tiles with bf16), ``avx512_bf16``
(AVX-512 with bfloat16 dot products), ``avx512`` (AVX-512F/BW/VL), ``avx2`` (AVX2 + FMA), or
``baseline``. A requested ISA above what the processor has is refused, naming both; one below it
caps every library the engine computes through, so the AVX2 figures of an AVX-512 machine can be
measured. The caps are environment variables those libraries read when they first start
(``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, ``ATEN_CPU_CAPABILITY``), so they bind only if
set before the process's first torch operation: the CLI applies them before it loads anything.

The projections follow from the ISA (``linear_path``): from AVX2 up, oneDNN with each weight
packed once at load into its blocked layout; below, MKL's SGEMM. Measured on the default
model's shapes with 2 threads of an AVX-512 (bf16) EPYC, natively and capped at AVX2
(benchmarks/cpu_matmul.py, docs/bench/cpu_matmul.md): float32 at 32-2048 rows, packed oneDNN
181-210 GFLOP/s against MKL's 130-190 (lm_head 162-191 against 63-135), and at 4-8 rows 1.3-3.6x;
capped at AVX2 the same order. On a 2-core AMX Xeon oneDNN and MKL were level from 16 rows
(330-365 GFLOP/s at 256-2048). A few rows (decode) go through the engine's C kernels, which
stream each weight once (42-76 GFLOP/s at one row against oneDNN's 11-50); up to how many is
measured on the machine (``cpu_measured``: 12 on that Xeon, where the fixed rule said 4). bfloat16 with
hardware dot products doubles the rate with avx512_bf16 (packed oneDNN 330-425 GFLOP/s from 32
rows) and with AMX tiles multiplies it by 5-6 (1,900-2,300 GFLOP/s at 2,048 rows); without
them bfloat16 is emulated at 25-45 GFLOP/s, so float32 stays the default everywhere.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.configs import ConfigError

log = logging.getLogger(__name__)

# Weakest to strongest; each needs the flags listed (as /proc/cpuinfo names them).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
    "avx512_bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"),
}
ORDER = list(ISA_FLAGS)
CPU_ISA_CHOICES = ("auto", *ORDER)
# What each library is told, per ISA (None: no cap, the library's own choice).
_ONEDNN = {"baseline": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
           "amx": None}
_MKL = {"baseline": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512", "amx": None}
_ATEN = {"baseline": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": None}
ENV_ISA = "PDSERVE_CPU_ISA"  # read by cpu_kernels: the C kernels are compiled for this ISA


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


def describe_cpu() -> str:
    """The processor's name, core count and vector flags, for the head of every benchmark table."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    name = next((x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("model name")), "unknown CPU")
    vector = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    return f"{name}, {os.cpu_count()} cores; flags: {' '.join(vector)}"


def best_isa(flags: frozenset[str]) -> str:
    return [isa for isa in ORDER if all(f in flags for f in ISA_FLAGS[isa])][-1]


def active_isa() -> str:
    """The ISA this process computes with: the one ``CpuPlan.apply_env`` set, else the processor's best."""
    return os.environ.get(ENV_ISA) or best_isa(cpu_flags())


def int8_dot() -> bool:
    """Whether this process's int8 matmuls (``torch._int_mm``) have dot-product instructions: AVX-512
    VNNI (or AMX) on a processor that has them, oneDNN not capped below AVX-512. Without them torch's
    CPU ``_int_mm`` is no kernel worth calling: ~3 GOP/s at 512 x 576 x 1536 on 2 AVX2 Zen 3 cores,
    against ~50 GFLOP/s in float32; and capped at AVX2 on a VNNI processor oneDNN's kernels saturate."""
    return ORDER.index(active_isa()) >= ORDER.index("avx512") and "avx512_vnni" in cpu_flags()


@dataclass(frozen=True)
class CpuPlan:
    """The ISA the engine computes with, and why."""

    isa: str
    native: str  # the best the processor has
    requested: str

    @property
    def linear_path(self) -> str:
        """How projections of more than a few rows run: ``onednn`` (packed weights) or ``mkl``."""
        import torch

        usable = torch.backends.mkldnn.is_available() and ORDER.index(self.isa) >= ORDER.index("avx2")
        return "onednn" if usable else "mkl"

    def linear_path_for(self, dtype) -> str:
        """``linear_path`` for weights of ``dtype``: half-precision packs need oneDNN's support for
        it here (bf16: AVX-512 core; fp16: AVX-512 FP16 or AVX-NE-CONVERT), else MKL/torch."""
        import torch

        if dtype == torch.bfloat16 and not (self.bf16_dot and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return "mkl"
        if dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return "mkl"
        return self.linear_path

    @property
    def bf16_dot(self) -> bool:
        """Whether bfloat16 matmuls have hardware dot products (otherwise bfloat16 is slow here)."""
        return ORDER.index(self.isa) >= ORDER.index("avx512_bf16")

    def describe(self) -> str:
        from pdserve.engine.cpu_kernels import AMX_ROWS
        from pdserve.engine.quant.formats import BF16Linear

        why = (f"the processor's best (flags: {', '.join(ISA_FLAGS[self.native]) or 'none of avx2/avx512'})"
               if self.requested == "auto" else f"--cpu-isa {self.requested} (the processor has {self.native})")
        paths = {"onednn": "float32 projections through oneDNN with packed weights",
                 "mkl": "float32 projections through MKL's SGEMM"}
        bf16 = "bfloat16 has dot products" if self.bf16_dot else "bfloat16 would be emulated (slow): keep float32"
        if self.isa == "amx":
            bf16 += (" and AMX tiles (a bf16 model's prefill attention and its projections of up to "
                     f"{AMX_ROWS} rows, and on to where oneDNN overtakes, measured per shape, where Linux lends them; "
                     "PDSERVE_AMX_OFF=1 keeps them off)")
        elif self.bf16_dot:
            bf16 += (f" (a bf16 model's projections from one row up to {BF16Linear.DP_ROWS}, and on to where oneDNN "
                     "overtakes, measured per shape, through our vdpbf16ps kernel; PDSERVE_DP_OFF=1 keeps it off)")
        return (f"CPU ISA {self.isa}: {why}; {paths[self.linear_path]}, a few rows through the C kernels (how many: "
                f"measured, cpu_measured); {bf16}")

    def apply_env(self) -> None:
        """Cap the libraries at this ISA (a no-op for the processor's own best: they choose it)."""
        os.environ[ENV_ISA] = self.isa
        if self.isa == self.native:
            return
        for var, table in (("ONEDNN_MAX_CPU_ISA", _ONEDNN), ("MKL_ENABLE_INSTRUCTIONS", _MKL),
                           ("ATEN_CPU_CAPABILITY", _ATEN)):
            if table[self.isa] is not None:
                os.environ[var] = table[self.isa]


def select_isa(requested: str = "auto", flags: frozenset[str] | None = None) -> CpuPlan:
    """The plan for ``requested`` (``auto`` or an ISA name) on a processor with ``flags``."""
    flags = cpu_flags() if flags is None else flags
    native = best_isa(flags)
    if requested not in CPU_ISA_CHOICES:
        raise ConfigError(f"cpu_isa: {requested!r} is not one of {list(CPU_ISA_CHOICES)}")
    if requested == "auto":
        return CpuPlan(native, native, requested)
    if ORDER.index(requested) > ORDER.index(native):
        missing = [f for f in ISA_FLAGS[requested] if f not in flags]
        raise ConfigError(f"cpu_isa: {requested} needs {', '.join(missing)}, which this processor lacks "
                          f"(its best: {native})")
    return CpuPlan(requested, native, requested)
