"""The C kernels of ``csrc/`` (``cpu_kernels.c``, ``cpu_attention.c``, ``cpu_gguf.c``, ``cpu_qdot.c``, ``cpu_amx.c``,
``cpu_dpbf16.c``): compiled once
per machine into one library on first use, loaded through ctypes.

The shared object is cached under ``$PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``), keyed
by the sources, the compiler flags and the CPU's vector extensions. No compiler, or a failed
build, means ``load_kernels()`` returns None and callers use their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_kernels.c", "cpu_attention.c", "cpu_gguf.c",
                                                                   "cpu_qdot.c", "cpu_amx.c", "cpu_dpbf16.c")]
# included by the sources: part of the build's key
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_vec.h", "cpu_amx.h")]


GGUF_KERNEL_TYPES = ("q8_0", "q4_0", "q4_1")  # GGML types cpu_gguf.c multiplies from their blocks


def _cpu_flags() -> list[str]:
    """Compiler flags for the ISA the engine computes with (cpu_isa.py; the processor's best
    unless capped through ``PDSERVE_CPU_ISA``)."""
    from pdserve.engine.cpu_isa import ORDER, active_isa, cpu_flags

    isa = active_isa()
    level = ORDER.index(isa) if isa in ORDER else 0
    chosen = []
    if level >= ORDER.index("avx2"):
        chosen += ["-mavx2", "-mfma", "-mf16c"]  # (every AVX2 processor has F16C)
    if level >= ORDER.index("avx512"):
        chosen += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mprefer-vector-width=512"]
        if "avx512_vnni" in cpu_flags():  # int8 dot products: cpu_qdot.c
            chosen += ["-mavx512vnni"]
    if level >= ORDER.index("avx512_bf16"):
        chosen += ["-mavx512bf16"]
    if level >= ORDER.index("amx"):  # a bf16 model's prefill attention on AMX tiles: cpu_attention.c
        chosen += ["-mamx-tile", "-mamx-bf16"]
    return chosen


def cache_root() -> Path:
    """Where what is built or measured once per machine is kept (``PDSERVE_CACHE_DIR``)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def _cache_dir() -> Path:
    return cache_root() / "kernels"


@cache
def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        log.info("no C compiler: CPU attention uses the torch path")
        return None
    # -ffast-math lets the compiler vectorise the softmax's expf (glibc's libmvec) and the dot
    # products' reductions; the kernel keeps every value finite, as fast-math assumes. It is given
    # when compiling only: linked with it, gcc adds crtfastmath.o, whose constructor turns on
    # flush-to-zero for the whole process as the library loads (every float op of torch and the rest
    # after it; Hypothesis refused to generate floats under it, which is how it was found).
    compile_flags = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", *_cpu_flags()]
    link_flags = ["-shared", "-fopenmp"]
    key = hashlib.sha256(b"".join(src.read_bytes() for src in [*SOURCES, *HEADERS])
                         + " ".join([compiler, *compile_flags, "|", *link_flags]).encode())
    target = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built, objs = Path(tmp) / target.name, [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
            steps = [[compiler, *compile_flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
            for step in [*steps, [compiler, *link_flags, *map(str, objs), "-o", str(built), "-lmvec", "-lm"]]:
                proc = subprocess.run(step, capture_output=True, text=True)
                if proc.returncode:
                    log.warning("building the CPU kernels failed; using the torch path:\n%s", proc.stderr)
                    return None
            os.replace(built, target)  # atomic: concurrent workers never load a half-written file
    lib = ctypes.CDLL(str(target))
    from pdserve.engine.cpu_isa import active_isa

    lib.isa = active_isa()  # what it was built for (the process's ISA may be set again later: CpuPlan.apply_env)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    f32 = ctypes.c_float
    signatures = {
        "paged_decode_f32": [ptr] * 7 + [i64] * 6 + [f32, i64],
        "rms_norm_f32": [ptr] * 5 + [i64] * 2 + [f32] + [i64] * 2,
        "rope_qkv_f32": [ptr, i64, ptr, ptr] + [i64] * 4,
        "silu_mul_f32": [ptr] * 2 + [i64] * 2,
        "silu_mul_bf16": [ptr] * 2 + [i64] * 2,
        "write_kv_f32": [ptr] * 6 + [i64] * 6,
        "write_kv_bf16": [ptr] * 6 + [i64] * 6,
        "write_kv_i8": [ptr] * 6 + [i64] * 6,
        "write_kv_f8": [ptr] * 6 + [i64] * 6,
        "gemm_rows_f32": [ptr] * 3 + [i64] * 3,
        "gemm_rows_bf16_f32": [ptr] * 3 + [i64] * 3,
        "paged_prefill_f32": [ptr] * 5 + [i64] * 9 + [f32, i64, i64, i64, ptr, ptr, i64, i64],
        "paged_attention_f32_fits": [i64] * 4,
        "paged_prefill_bf16_products": [],
        **{f"gguf_gemm_{t}": [ptr] * 3 + [i64] * 4 for t in GGUF_KERNEL_TYPES},
        "qdot_gemm_q4": [ptr] * 3 + [i64] * 4,
        "qdot_gemm_q8": [ptr] * 3 + [i64] * 4,
        "qdot_available": [],
        "amx_gemm_available": [],
        "amx_pack_bf16": [ptr, ptr, i64, i64],
        "amx_gemm_bf16": [ptr, i64, ptr, ptr, i64, i64, i64, i64],
        "amx_gemm_bf16_many": [ptr, i64, ptr, ptr, i64, i64, i64, i64],
        "amx_swiglu_bf16": [ptr, i64, ptr, ptr, i64, i64, i64],
        "dp_gemm_available": [],
        "dp_gemm_bf16": [ptr, i64, ptr, ptr, i64, i64, i64, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    for name in ("paged_decode_f32", "paged_prefill_f32", "paged_attention_f32_fits", "paged_prefill_bf16_products",
                 "qdot_available", "qdot_gemm_q4", "qdot_gemm_q8", "amx_gemm_available", "amx_gemm_bf16",
                 "amx_gemm_bf16_many", "amx_swiglu_bf16", "dp_gemm_available", "dp_gemm_bf16"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


# What a cache holds, as the attention kernels take it (cpu_attention.c's kv_kind): float32, bfloat16, or an
# int8 or fp8 (e4m3) cache's elements (kv_quant.py: the view of each (block, head) row's one-byte part, its
# scales after it)
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 blocks: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, window: int,
                 scale: float) -> torch.Tensor | None:
    """Decode attention of ``n`` one-token requests (``q`` ``[n, H, D]``; the block table as
    ``AttentionMetadata`` has it, ``attention.windowed``'s when ``window`` is set). None when the
    kernel could not allocate its scratch (the caller computes it another way). The cache: float32 or
    bfloat16 (``usable_cache``), or an int8 or fp8 cache's elements (``KV_KINDS``)."""
    q = q.contiguous()
    n, h, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    out = torch.empty_like(q)
    failed = lib.paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), starts.data_ptr(),
        lens.data_ptr(), out.data_ptr(), n, window, h, kvh, d, bs, scale, KV_KINDS[v_cache.dtype],
    )
    return None if failed else out


def paged_prefill(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_ids: torch.Tensor, context_len: int, window: int, scale: float,
                  bf16_products: bool = False, out: torch.Tensor | None = None,
                  fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Attention of a prefill chunk (``q`` ``[n, H, D]``, see ``rows_of_heads``) over its context and
    itself, read from the cache in place (the chunk's keys and values already written); causal, and
    within ``window`` positions when it is non-zero. ``bf16_products``: the scores and the values
    multiplied in bfloat16 (dot products; where the kernels were built with them, else float32).
    None when the kernel could not allocate its scratch (the caller computes it another way). ``out``:
    where the answer goes (``[n, H, D]``, ``rows_of_heads``: float32, or bfloat16 rounded as ``.to``
    rounds), else a new float32 tensor. ``fresh``: over an int8 or fp8 cache, the chunk's own keys and values
    as the projection gave them (``rows_of_heads``), attended unquantized (the cached context dequantized once
    per call: into AMX tiles' pairs, or a float32 copy of the blocks); without them the cache's copies are read."""
    n, h, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    if out is None:
        out = torch.empty(n, h, d, dtype=torch.float32)
    k_new, v_new = fresh if fresh is not None else (None, None)
    failed = lib.paged_prefill_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(), out.data_ptr(), n,
        context_len, window, h, kvh, d, bs, q.stride(0), out.stride(0), scale, int(bf16_products),
        KV_KINDS[v_cache.dtype], int(out.dtype == torch.bfloat16),
        None if k_new is None else k_new.data_ptr(), None if v_new is None else v_new.data_ptr(),
        0 if k_new is None else k_new.stride(0), 0 if v_new is None else v_new.stride(0),
    )
    return None if failed else out


@cache
def attention_fits(lib: ctypes.CDLL, heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the attention kernels take this shape (``paged_attention_f32_fits``), asked once per shape."""
    return bool(lib.paged_attention_f32_fits(heads, kv_heads, head_dim, block_size))


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors as they are (float32, contiguous, on CPU)."""
    for t in tensors:  # (a loop and is_cpu: ~5 of these a layer, a third of the generator's time)
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def usable_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the attention kernels and the KV write can take this cache as it is: float32 or
    bfloat16 (``--kv-cache-dtype bfloat16``), contiguous, on CPU."""
    dtype = k_cache.dtype
    return ((dtype is torch.float32 or dtype is torch.bfloat16) and v_cache.dtype is dtype and k_cache.is_cpu
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype = torch.float32):
    """``(norm(x + residual), x + residual)``, or ``norm(x)`` when there is no residual. ``x`` float32 or
    bfloat16 (widened as it is read); the norm in ``out_dtype`` (float32 or bfloat16), the sum in float32."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=out_dtype)
    x_bf16, out_bf16 = int(x.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16)
    if residual is None:
        lib.rms_norm_f32(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), rows, dim, eps, x_bf16,
                         out_bf16)
        return out
    new_residual = torch.empty(rows, dim, dtype=torch.float32)
    lib.rms_norm_f32(x.data_ptr(), residual.data_ptr(), new_residual.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), rows, dim, eps, x_bf16, out_bf16)
    return out, new_residual


def rope_qkv(lib: ctypes.CDLL, qkv: torch.Tensor, rot: torch.Tensor, rot_heads: int, head_dim: int) -> torch.Tensor:
    """The fused projection ``qkv`` (contiguous ``[T, heads * head_dim]``, float32 or bfloat16) in float32,
    its first ``rot_heads`` heads rotated by ``rot`` (``RotaryEmbedding``'s ``[T, 1, head_dim / 2]``
    complex64, contiguous) as ``model.apply_rope`` rotates them."""
    t, width = qkv.shape
    out = torch.empty(t, width, dtype=torch.float32)
    lib.rope_qkv_f32(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), torch.view_as_real(rot).data_ptr(),
                     out.data_ptr(), t, rot_heads, width // head_dim, head_dim)
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a contiguous ``[rows, 2n]`` product, float32 or bfloat16 (``silu_mul_bf16``: the
    arithmetic in float32, the result rounded to bfloat16); out in its dtype."""
    rows, two_n = gate_up.shape
    out = torch.empty(rows, two_n // 2, dtype=gate_up.dtype)
    kernel = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul_f32
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, two_n // 2)
    return out


AMX_ROWS = 64  # rows of the decode kernel amx_gemm_bf16 (csrc/cpu_amx.c); more go to amx_gemm_bf16_many


def amx_pack(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 ``[N, K]`` weight in AMX's tiles for ``amx_gemm`` (``amx_pack_bf16``), or None where
    that cannot run (no AMX here, or N and K not multiples of 32)."""
    return _pairs(lib, weight) if lib.amx_gemm_available() else None


def dp_pack(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 ``[N, K]`` weight for ``dp_gemm`` (the layout of AMX's tiles, which bf16 dot products read
    too), or None where that cannot run (built without them, or N and K not multiples of 32)."""
    return _pairs(lib, weight) if lib.dp_gemm_available() else None


def _pairs(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor | None:
    n, k = weight.shape
    if n % 32 or k % 32 or weight.dtype != torch.bfloat16:
        return None
    w = weight.contiguous()
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    lib.amx_pack_bf16(w.data_ptr(), packed.data_ptr(), n, k)
    return packed


def amx_gemm(lib: ctypes.CDLL, packed: torch.Tensor, n: int, x: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor | None:
    """``x W^T`` on AMX tiles (W ``amx_pack``'s, ``n`` rows): ``x`` contiguous ``[M, K]`` float32 or
    bfloat16; the answer rounded to bfloat16 as oneDNN's is, in ``out_dtype`` (float32 or bfloat16).
    Up to ``AMX_ROWS`` rows the kernel that streams W once (decode steps), more the one that runs the
    rows past each thread's half of W (``amx_gemm_bf16_many``: prefill steps). None where it does not
    run (then nothing was written)."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    kernel = lib.amx_gemm_bf16 if m <= AMX_ROWS else lib.amx_gemm_bf16_many
    failed = kernel(x.data_ptr(), int(x.dtype == torch.bfloat16), packed.data_ptr(), out.data_ptr(),
                    int(out_dtype == torch.bfloat16), m, n, k)
    return None if failed else out


def dp_gemm(lib: ctypes.CDLL, packed: torch.Tensor, n: int, x: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor | None:
    """``x W^T`` with bf16 dot products (W ``dp_pack``'s, ``n`` rows; ``csrc/cpu_dpbf16.c``), the same answer as
    ``amx_gemm``'s: ``x`` contiguous ``[M, K]`` float32 or bfloat16, rounded to bfloat16; the products summed in
    float32 and rounded to bfloat16, in ``out_dtype`` (float32 or bfloat16). None where it does not run."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    failed = lib.dp_gemm_bf16(x.data_ptr(), int(x.dtype == torch.bfloat16), packed.data_ptr(), out.data_ptr(),
                              int(out_dtype == torch.bfloat16), m, n, k)
    return None if failed else out


def amx_swiglu(lib: ctypes.CDLL, packed: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU of ``x W^T`` for a fused gate_up W (``amx_pack``'s, ``n`` rows: gate then up) on AMX
    tiles, applied as the tiles are stored: ``[M, n / 2]`` bfloat16, equal bit for bit to ``silu_mul``
    of ``amx_gemm``'s bfloat16 product. ``x`` contiguous float32 or bfloat16. None where it does not run."""
    m, k = x.shape
    out = torch.empty(m, n // 2, dtype=torch.bfloat16)
    failed = lib.amx_swiglu_bf16(x.data_ptr(), int(x.dtype == torch.bfloat16), packed.data_ptr(), out.data_ptr(),
                                 m, n, k)
    return None if failed else out


def gemm_rows(lib: ctypes.CDLL, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a few float32 rows, reading ``weight`` (float32 or bfloat16) once: ``x``
    ``[m, k]`` contiguous; float32 out."""
    n, k = weight.shape
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    kernel = lib.gemm_rows_bf16_f32 if weight.dtype == torch.bfloat16 else lib.gemm_rows_f32
    kernel(weight.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, m)
    return out


def rows_of_heads(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """``[T, heads, D]`` of ``dtypes`` (float32) with each row's heads contiguous (rows may be apart)."""
    return x.dtype in dtypes and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(lib, k, v, k_cache, v_cache, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Store ``k`` and ``v`` (``[T, kv_heads, D]``, see ``rows_of_heads``) in their slots (of a float32
    or bfloat16 cache: ``usable_cache``; or an int8 or fp8 cache's elements, ``KV_KINDS``: each token and
    head quantized as ``kv_quant.quantize`` does, bit for bit, its scale after the block's elements)."""
    t, kvh, d = k.shape
    kernel = (lib.write_kv_f32, lib.write_kv_bf16, lib.write_kv_i8, lib.write_kv_f8)[KV_KINDS[v_cache.dtype]]
    kernel(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), offsets.data_ptr(),
           t, kvh, v_cache.shape[2], d, k.stride(0), v.stride(0))


def keep_thread_serial() -> bool:
    """Run torch's OpenMP work on one thread in the calling thread, and only in it: for the threads
    beside the engine's step loop (a worker's event loop, the KV export thread), which may copy a
    tensor now and then but must not get an OpenMP team of their own.

    GNU OpenMP keeps a team of threads for every thread that ran a parallel region, and once the
    process holds more of those threads than it has cores it shortens every team's wait for work
    from ~3 ms of spinning to 100 spins, then sleep: the engine's team then sleeps between the
    hundreds of parallel regions of a step and wakes through the kernel for each. On a 2-core Xeon
    a decode step run in a thread other than the one that had loaded the model took 43 ms instead
    of 28 (OMP_WAIT_POLICY=ACTIVE: 54, the first team spinning on a core). Returns whether it took
    effect (torch on GNU OpenMP)."""
    if not torch.backends.openmp.is_available():
        return False
    torch.get_num_threads()  # torch's set-up of this thread first: on its first use it sets the count again
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the runtime torch loaded (same soname), not a second one
    except OSError:
        return False
    gomp.omp_set_num_threads(1)
    return True


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed blocks instead of returning them to the OS.

    Activations of a few MB are allocated and freed every layer. By default glibc serves them
    with fresh ``mmap`` pages that fault in (zeroed by the kernel) on every use: measured here,
    that made a 512-row RMSNorm 15x slower and a prefill step 20-30% slower. Raising the mmap
    and trim thresholds keeps those blocks in the heap. Process-wide; a no-op off glibc. What the
    heap then keeps is bounded by ``HeapBound``, which the engine runs after its steps.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) or libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 62 if ctypes.sizeof(ctypes.c_long) == 8 else 1 << 30)
    libc.mallopt(m_top_pad, 64 << 20)
    return bool(ok)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


HEAP_FREE_LIMIT = 512 << 20  # bytes of freed memory the heap may keep before it is given back


class HeapBound:
    """Gives freed heap memory back to the OS once there is more than ``limit`` of it.

    With ``keep_freed_memory`` glibc never trims, so the heap keeps the most it ever held, and
    fragmentation keeps more: blocks of sizes not seen before land past freed ones that are a
    little too small. Requests for prompt logprobs with growing prompts (each step's logits, up
    to the token budget's rows x the vocabulary) grew a worker of the tiny model from 0.3 to
    4.3 GB in 25 requests while it used 0.2 GB. ``check`` (after each step, at most every
    ``every_s``) reads glibc's free bytes over all arenas (``mallinfo2``, microseconds) and, when
    they have grown by more than the limit since the last trim (since start-up: by more than the
    limit at all), calls ``malloc_trim(0)``, which releases the pages of free blocks anywhere in
    the heap; blocks in use stay where they are.

    Growth, not the free total: blocks given back stay free blocks (glibc's count does not drop),
    so a bound on the total, once passed, trimmed at every look for good, handing back the pages
    the last steps' activations had faulted in for the next steps to fault in again (a served
    worker gave back 68-71 MiB after every request; a bf16 step of 4 x 512 prompt tokens after a
    trim 425 ms against 406, its 71 MiB faulted in again). The baseline is the least free seen
    since the trim, so memory taken out of the trimmed blocks (faulted in) and freed again counts
    as growth; a steady load's activations, freed between looks, keep their pages. ``None`` from
    ``create`` off glibc (or an old one).
    """

    def __init__(self, libc, limit: int = HEAP_FREE_LIMIT, every_s: float = 1.0):
        self._libc, self.limit, self.every_s = libc, limit, every_s
        self._next = 0.0
        self.trims = 0  # calls to malloc_trim
        self._baseline = 0  # free bytes not counted against the limit: the least seen since the last trim

    @classmethod
    def create(cls, limit: int = HEAP_FREE_LIMIT, every_s: float = 1.0) -> HeapBound | None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = _MallInfo2
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            return None
        return cls(libc, limit, every_s)

    def info(self) -> _MallInfo2:
        """glibc's ``mallinfo2`` over all arenas: ``arena`` (the heap's size), ``uordblks`` (in use),
        ``fordblks`` (free)."""
        return self._libc.mallinfo2()

    def free_bytes(self) -> int:
        """Free bytes in malloc's arenas (resident or already given back)."""
        return self.info().fordblks

    def check(self, now: float) -> bool:
        """Trim if it is time to look and the heap's free bytes have grown by more than ``limit`` since
        the last trim (see the class); whether it trimmed."""
        if now < self._next:
            return False
        self._next = now + self.every_s
        free = self.free_bytes()
        self._baseline = min(self._baseline, free)
        if free - self._baseline <= self.limit:
            return False
        before = resident_bytes()
        self._libc.malloc_trim(0)
        self.trims += 1
        self._baseline = self.free_bytes()  # given back, still free blocks
        released = before - resident_bytes()
        if released >= 64 << 20:
            log.info("gave %d MiB of freed heap memory back to the OS (free memory grew by over %d MiB)",
                     released >> 20, self.limit >> 20)
        return True


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gguf_gemm(lib: ctypes.CDLL, ggml_type: str, blocks: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ W^T`` with W given as a GGUF tensor's raw blocks (``blocks``: uint8 ``[n, bytes a
    row]``; ``ggml_type`` one of ``GGUF_KERNEL_TYPES``); ``x`` float32 ``[m, k]`` contiguous, ``out`` a
    float32 ``[m, n]`` view whose rows may be longer (a fused projection's columns)."""
    m, k = x.shape
    assert out.shape == (m, blocks.shape[0]) and out.stride(1) == 1 and x.is_contiguous() and blocks.is_contiguous()
    getattr(lib, f"gguf_gemm_{ggml_type}")(blocks.data_ptr(), x.data_ptr(), out.data_ptr(), blocks.shape[0], k, m,
                                           out.stride(0))


def qdot_gemm(lib: ctypes.CDLL, bits: int, tiles: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ W^T`` in int8 dot products (``cpu_qdot.c``; only where ``lib.qdot_available()``):
    ``tiles`` W packed by ``quant.qdot`` (``bits`` 4 or 8; ``qdot.fits`` its shape), ``x`` float32
    ``[m, k]`` contiguous, split in two int8 parts per 32 inputs by the kernel; ``out`` float32
    ``[m, n]`` with unit column stride (a fused projection's columns: its rows may be longer). (No
    checks here: a decode step makes ~120 of these calls.)"""
    m, k = x.shape
    kernel = lib.qdot_gemm_q4 if bits == 4 else lib.qdot_gemm_q8
    if kernel(tiles.data_ptr(), x.data_ptr(), out.data_ptr(), out.shape[1], k, m, out.stride(0)):
        raise MemoryError(f"qdot_gemm: no memory for the int8 parts of x ({m} x {k})")
