"""GPU kernels (pdserve/engine/triton_kernels.py): correctness against torch, speed against the HBM bound.

    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --check-only   # any machine: tiny sizes, interpreter
    python benchmarks/gpu_kernels.py                                    # a CUDA GPU: checks, then timings

(a) Checks, on fresh random inputs: the KV store, paged decode and prefill attention (GQA, odd
lengths, one-token sequences, several chunks in one launch), RMSNorm (+ residual) and RoPE, each
against a torch reference (attention in float64). Without CUDA the kernels run in Triton's
interpreter (set here when --check-only and no GPU) at tiny sizes and float32 only (the
interpreter gets bfloat16 wrong); on a GPU at Llama-3-8B head shapes in float32 and bfloat16.

(b) On CUDA only, timings (CUDA events, mean over --iters after a warm-up):
  - the device copy bandwidth (``dst.copy_(src)``, 1 GiB; bytes read + written per second), the
    bound every figure below is held to;
  - each kernel at Llama-3-8B shapes, with the torch path it replaces; decode attention also as a
    fraction of its bound (one layer's KV bytes read / copy bandwidth);
  - a whole decode step (model forward with the engine's metadata, CUDA graph replay unless
    --no-graphs, plus the final norm and lm_head) of ``random:llama-3-8b`` with random weights,
    at each --batch-sizes with --context tokens per request, as a fraction of its bound: (weight
    bytes, less the embedding table of which only B rows are read, + the KV bytes read) / copy
    bandwidth.

Prints tables; --json writes the numbers to a file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check-only", action="store_true",
                   help="run the correctness checks only (on a machine without CUDA this selects Triton's\n"
                        "interpreter and tiny sizes)")
    p.add_argument("--model", default="llama-3-8b", help="preset of the decode-step model (random weights); "
                                                         "default %(default)s")
    p.add_argument("--batch-sizes", default="1,16,64", help="decode batch sizes, comma-separated; default %(default)s")
    p.add_argument("--context", type=int, default=2048, help="context tokens per request; default %(default)s")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="weights, activations and KV cache of the timings; default %(default)s")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size; default %(default)s")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions of each measurement; default %(default)s")
    p.add_argument("--no-graphs", action="store_true", help="time decode steps eagerly instead of replaying "
                                                            "CUDA graphs")
    p.add_argument("--skip-model", action="store_true", help="kernel timings only, no whole decode steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights; default %(default)s")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


# ---- (a) correctness -------------------------------------------------------------------------


def dense_attention(q, k, v, context: int):
    """Float64 causal attention: ``q`` ``[m, heads, D]`` at positions ``context ..``, ``k, v`` ``[n, kvh, D]``."""
    import torch

    group = q.shape[1] // k.shape[1]
    q, k, v = q.double().transpose(0, 1), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q @ k.permute(1, 2, 0) / math.sqrt(q.shape[-1])
    keys, queries = torch.arange(k.shape[0], device=q.device), context + torch.arange(q.shape[1], device=q.device)
    scores = scores.masked_fill(keys[None, :] > queries[:, None], float("-inf"))
    return (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1)


def paged(lengths, kvh, hd, bs, dtype, device, gen):
    """A NaN-filled paged cache with random K/V for each length on shuffled blocks."""
    import torch

    from pdserve.engine import triton_kernels as tk

    needed = [-(-n // bs) for n in lengths]
    nblocks = sum(needed) + 2
    order = torch.randperm(nblocks, generator=gen).to(device)
    k_cache = torch.full((nblocks, kvh, hd, bs), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full((nblocks, kvh, bs, hd), float("nan"), dtype=dtype, device=device)
    tables, dense, used = [], [], 0
    for n, nb in zip(lengths, needed):
        table = order[used : used + nb]
        used += nb
        k = torch.randn(n, kvh, hd, generator=gen).to(device, dtype)
        v = torch.randn(n, kvh, hd, generator=gen).to(device, dtype)
        pos = torch.arange(n, device=device)
        tk.store_kv(k, v, k_cache, v_cache, table[pos // bs], pos % bs)
        tables.append(table)
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def slots(blocks, offsets):
    """Attention metadata saying only where new keys and values go (what attention.write_kv reads)."""
    import torch

    from pdserve.engine.attention import AttentionMetadata

    none = torch.empty(0, dtype=torch.long, device=blocks.device)
    return AttentionMetadata(slot_blocks=blocks, slot_offsets=offsets, num_decodes=0, decode_block_ids=none,
                             decode_block_req=none, decode_block_mask=none.bool(), decode_starts=none,
                             decode_lens=none, prefills=[])


def checks(device, on_gpu: bool, seed: int = 0) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pdserve.engine import triton_kernels as tk
    from pdserve.engine.attention import write_kv
    from pdserve.engine.config import RopeScaling
    from pdserve.engine.model import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    rows = []
    dtypes = [torch.float32, torch.bfloat16] if on_gpu else [torch.float32]
    attn_tol = {torch.float32: 2e-5 if not on_gpu else 1e-4, torch.bfloat16: 2e-2}
    if on_gpu:
        shapes = [(32, 8, 128, 16), (32, 32, 128, 16), (24, 8, 64, 16)]
        lengths, chunks = [1, 17, 2047, 513, 1000], [(0, 300), (1000, 77), (5, 1), (16, 513)]
    else:
        shapes = [(2, 2, 16, 16), (6, 2, 20, 5), (8, 1, 32, 16)]
        lengths, chunks = [1, 17, 40], [(0, 7), (19, 5), (3, 1)]

    def record(name, err, tol):
        rows.append({"check": name, "max_abs_err": err, "tolerance": tol, "ok": bool(err <= tol)})

    for dtype in dtypes:
        tname = str(dtype).removeprefix("torch.")
        kvh, hd, bs = shapes[0][1:]
        k_cache = torch.randn(5, kvh, hd, bs, generator=gen).to(device, dtype)
        v_cache = torch.randn(5, kvh, bs, hd, generator=gen).to(device, dtype)
        k, v = (torch.randn(3, kvh, hd, generator=gen).to(device, dtype) for _ in range(2))
        blocks, offsets = torch.tensor([4, -1, 0], device=device), torch.tensor([3, 0, bs - 1], device=device)
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        write_kv(k[[0, 2]], v[[0, 2]], expected_k, expected_v, slots(blocks[[0, 2]], offsets[[0, 2]]))
        tk.store_kv(k, v, k_cache, v_cache, blocks, offsets)
        err = max(float((k_cache - expected_k).abs().max()), float((v_cache - expected_v).abs().max()))
        record(f"store_kv (a padding slot skipped), {tname}", err, 0.0)
        for heads, kvh, hd, bs in shapes:
            label = f"{tname} H{heads}/KV{kvh} D{hd} bs{bs}"
            k_cache, v_cache, tables, dense = paged(lengths, kvh, hd, bs, dtype, device, gen)
            q = torch.randn(len(lengths), heads, hd, generator=gen).to(device, dtype)
            starts = torch.tensor([0] + [len(t) for t in tables]).cumsum(0).to(device)
            lens = torch.tensor(lengths, device=device)
            for splits in (1, 4):
                out = tk.paged_decode(q, k_cache, v_cache, torch.cat(tables), starts, lens, hd**-0.5, num_splits=splits)
                err = max(float((out[r : r + 1].double() - dense_attention(q[r : r + 1], k, v, n - 1)).abs().max())
                          for r, (n, (k, v)) in enumerate(zip(lengths, dense)))
                record(f"decode, {splits} split(s), {label}", err, attn_tol[dtype])

            k_cache, v_cache, tables, dense = paged([c + n for c, n in chunks], kvh, hd, bs, dtype, device, gen)
            total = sum(n for _, n in chunks)
            q = torch.randn(total, heads, hd, generator=gen).to(device, dtype)
            out = torch.zeros_like(q)
            q_starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)[:-1]
            ints = [t.to(device) for t in (torch.tensor([0] + [len(t) for t in tables]).cumsum(0)[:-1], q_starts,
                                           torch.tensor([n for _, n in chunks]), torch.tensor([c for c, _ in chunks]))]
            tk.paged_prefill(q, k_cache, v_cache, out, torch.cat(tables), *ints, max(n for _, n in chunks), hd**-0.5)
            err = max(float((out[s : s + n].double() - dense_attention(q[s : s + n], k, v, c)).abs().max())
                      for (c, n), s, (k, v) in zip(chunks, q_starts.tolist(), dense))
            record(f"prefill, {len(chunks)} chunks, {label}", err, attn_tol[dtype])

        hidden = 4096 if on_gpu else 100
        x, res = (torch.randn(7, hidden, generator=gen).to(device, dtype) for _ in range(2))
        w = torch.randn(hidden, generator=gen).to(device, dtype)
        norm_tol = 1e-5 if dtype == torch.float32 else 3e-2
        got, new_res = tk.rms_norm(x, res, w, 1e-5)
        expected = F.rms_norm((x + res).float(), (hidden,), w.float(), 1e-5)
        record(f"rms_norm + residual, {tname}", float((got.float() - expected).abs().max()), norm_tol)
        record(f"  its residual, {tname}", float((new_res - (x + res)).abs().max()), 0.0)
        got = tk.rms_norm(x, None, w, 1e-5)
        record(f"rms_norm, {tname}", float((got.float() - F.rms_norm(x.float(), (hidden,), w.float(), 1e-5))
                                           .abs().max()), norm_tol)

        hd, heads = (128, 40) if on_gpu else (24, 6)
        rope = RotaryEmbedding(hd, 8192, 500000.0, RopeScaling(factor=8.0))
        positions = torch.randint(0, 8192, (9,), generator=gen)
        rot = rope(positions)
        x = torch.randn(9, heads + 3, hd, generator=gen).to(dtype)[:, :heads]  # strided rows
        xc = torch.view_as_complex(x.float().reshape(9, heads, hd // 2, 2))  # model.apply_rope, on the CPU
        expected = torch.view_as_real(xc * rot).reshape(9, heads, hd)
        got = tk.rope(x.to(device), rot.to(device)).float().cpu()
        record(f"rope, {tname}", float((got - expected).abs().max()), 1e-5 if dtype == torch.float32 else 2e-2)
    return rows


# ---- (b) timings ----------------------------------------------------------------------------


def cuda_time(fn, iters: int) -> float:
    """Mean seconds of ``fn`` on the GPU over ``iters`` back-to-back calls, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(iters: int) -> float:
    """Bytes read plus bytes written per second by a 1 GiB device-to-device copy."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(partial(dst.copy_, src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 / seconds


def torch_rms_norm(x, residual, weight, eps):
    """The unfused path model.RMSNorm takes off the GPU."""
    import torch.nn.functional as F

    h = x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


def torch_rope(x, rot):
    """model.apply_rope's torch path."""
    import torch

    t, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(xc * rot).view(t, h, d).to(x.dtype)


def kernel_timings(args, dtype, bw: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pdserve.engine import triton_kernels as tk
    from pdserve.engine.config import PRESETS
    from pdserve.engine.model import RotaryEmbedding

    cfg = PRESETS[args.model]
    heads, kvh, hd, bs, ctx = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.block_size, args.context
    esize = torch.empty(0, dtype=dtype).element_size()
    rows = []

    def row(name, seconds, bound_bytes=None, torch_seconds=None):
        rows.append({"kernel": name, "us": seconds * 1e6, "torch_us": None if torch_seconds is None else
                     torch_seconds * 1e6, "of_bound": None if bound_bytes is None else bound_bytes / bw / seconds})

    for b in (int(x) for x in args.batch_sizes.split(",")):
        nb = -(-ctx // bs)
        k_cache = torch.randn(b * nb, kvh, hd, bs, dtype=dtype, device="cuda")
        v_cache = torch.randn(b * nb, kvh, bs, hd, dtype=dtype, device="cuda")
        q = torch.randn(b, heads, hd, dtype=dtype, device="cuda")
        blocks = torch.arange(b * nb, device="cuda")
        starts = torch.arange(b + 1, device="cuda") * nb
        lens = torch.full((b,), ctx, device="cuda")
        kv_bytes = 2 * b * ctx * kvh * hd * esize
        t = cuda_time(partial(tk.paged_decode, q, k_cache, v_cache, blocks, starts, lens, hd**-0.5), args.iters)
        sdpa_q = q.view(b, kvh, heads // kvh, hd)
        keys = k_cache.view(b, nb, kvh, hd, bs).permute(0, 2, 1, 4, 3).reshape(b, kvh, nb * bs, hd)
        values = v_cache.view(b, nb, kvh, bs, hd).transpose(1, 2).reshape(b, kvh, nb * bs, hd)
        t_torch = cuda_time(partial(F.scaled_dot_product_attention, sdpa_q, keys, values), args.iters)
        row(f"decode attention, B={b}, ctx {ctx} (one layer; torch: SDPA on gathered K/V)", t, kv_bytes, t_torch)
        k_new = torch.randn(b, kvh, hd, dtype=dtype, device="cuda")
        offsets = torch.zeros(b, dtype=torch.long, device="cuda")
        t = cuda_time(partial(tk.store_kv, k_new, k_new, k_cache, v_cache, blocks[:b], offsets), args.iters)
        row(f"store_kv, {b} tokens", t, 4 * b * kvh * hd * esize)
        del k_cache, v_cache, keys, values

    # Prefill: one 2048-token prompt, and four 512-token chunks after 1536 cached tokens each.
    for label, chunks in (("1 x 2048 new", [(0, 2048)]), ("4 x 512 after 1536 cached", [(1536, 512)] * 4)):
        nbs = [-(-(c + n) // bs) for c, n in chunks]
        k_cache = torch.randn(sum(nbs), kvh, hd, bs, dtype=dtype, device="cuda")
        v_cache = torch.randn(sum(nbs), kvh, bs, hd, dtype=dtype, device="cuda")
        total = sum(n for _, n in chunks)
        q = torch.randn(total, heads, hd, dtype=dtype, device="cuda")
        out = torch.empty_like(q)
        ints = [torch.tensor(x, device="cuda") for x in (
            [sum(nbs[:i]) for i in range(len(chunks))], [sum(n for _, n in chunks[:i]) for i in range(len(chunks))],
            [n for _, n in chunks], [c for c, _ in chunks])]
        blocks = torch.arange(sum(nbs), device="cuda")
        t = cuda_time(partial(tk.paged_prefill, q, k_cache, v_cache, out, blocks, *ints,
                              max(n for _, n in chunks), hd**-0.5), args.iters)
        flops = sum(4 * heads * hd * n * (c + (n + 1) / 2) for c, n in chunks)
        c0, n0 = chunks[0]
        qt = q[:n0].transpose(0, 1)[None]
        keys = torch.randn(1, kvh, c0 + n0, hd, dtype=dtype, device="cuda")
        mask = torch.arange(c0 + n0, device="cuda")[None, :] <= (c0 + torch.arange(n0, device="cuda"))[:, None]
        t_torch = len(chunks) * cuda_time(partial(F.scaled_dot_product_attention, qt, keys, keys, attn_mask=mask,
                                                  enable_gqa=heads > kvh), args.iters)
        row(f"prefill attention, {label} ({flops / t / 1e12:.0f} TFLOP/s; torch: SDPA, contiguous K/V)", t,
            None, t_torch)
        del k_cache, v_cache

    hidden = cfg.hidden_size
    for n in (1, 64, 2048):
        x, res = (torch.randn(n, hidden, dtype=dtype, device="cuda") for _ in range(2))
        w = torch.randn(hidden, dtype=dtype, device="cuda")
        t = cuda_time(partial(tk.rms_norm, x, res, w, 1e-5), args.iters)
        row(f"rms_norm + residual, {n} x {hidden}", t, 4 * n * hidden * esize,
            cuda_time(partial(torch_rms_norm, x, res, w, 1e-5), args.iters))
    rope = RotaryEmbedding(hd, 8192, cfg.rope_theta, cfg.rope_scaling).to("cuda")
    for n in (64, 2048):
        x = torch.randn(n, heads + 2 * kvh, hd, dtype=dtype, device="cuda")[:, : heads + kvh]
        rot = rope(torch.randint(0, 8192, (n,), device="cuda"))
        t = cuda_time(partial(tk.rope, x, rot), args.iters)
        row(f"rope, {n} tokens x {heads + kvh} heads", t, 2 * n * (heads + kvh) * hd * esize,
            cuda_time(partial(torch_rope, x, rot), args.iters))
    return rows


def eager_step(model, runner, ids, positions, meta):
    return model.compute_logits(model(ids, positions, runner.layer_caches, meta, runner.backend))


def graph_step(model, runner, ids, positions, meta):
    return model.compute_logits(runner.cuda_graphs.forward(ids, positions, meta))


def decode_steps(args, dtype, bw: float) -> list[dict]:
    import torch

    from pdserve.engine.attention import AttentionMetadata
    from pdserve.engine.config import PRESETS
    from pdserve.engine.cuda_graphs import to_device
    from pdserve.engine.loader import build_model
    from pdserve.engine.model_runner import ModelRunner

    cfg = PRESETS[args.model]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    bs, ctx = args.block_size, args.context
    nb = -(-ctx // bs)
    t0 = time.perf_counter()
    model = build_model(cfg, None, dtype, "cuda", max_positions=ctx + 1, seed=args.seed)
    model.rope.to("cuda")  # build_model leaves the rotary table of random-weight models on the CPU
    print(f"random {args.model} built on the GPU in {time.perf_counter() - t0:.0f} s", flush=True)
    runner = ModelRunner(model, max(batches) * nb, bs)
    runner.kv_cache.normal_()
    esize = runner.kv_cache.element_size()
    weight_bytes = (cfg.num_params - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)) * esize
    rows = []
    for b in batches:
        table = torch.arange(b * nb).view(b, nb)
        pos = torch.full((b,), ctx - 1)
        meta = AttentionMetadata(
            slot_blocks=table[:, (ctx - 1) // bs].contiguous(), slot_offsets=pos % bs, num_decodes=b,
            decode_block_ids=table.flatten(), decode_block_req=torch.arange(b).repeat_interleave(nb),
            decode_block_mask=(torch.arange(nb * bs).view(nb, bs) < ctx).repeat(b, 1),
            decode_starts=torch.arange(b + 1) * nb, decode_lens=torch.full((b,), ctx), prefills=[],
        )
        ids = torch.randint(0, cfg.vocab_size, (b,))
        with torch.inference_mode():
            if args.no_graphs:
                inputs = (ids.cuda(), pos.cuda(), to_device(meta, torch.device("cuda")))
                step = partial(eager_step, model, runner, *inputs)
            else:
                step = partial(graph_step, model, runner, ids, pos, meta)
            seconds = cuda_time(step, args.iters)
        read = weight_bytes + b * ctx * cfg.kv_bytes_per_token(esize)
        rows.append({"batch": b, "context": ctx, "ms": seconds * 1e3, "tokens_per_s": b / seconds,
                     "gb_read": read / 1e9, "bound_ms": read / bw * 1e3, "of_bound": read / bw / seconds,
                     "graphs": not args.no_graphs})
    return rows


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a text table; ``columns``: (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [["-" if r[k] is None else format(r[k], f) for k, _, f in columns]
                                            for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.check_only:
            print("timings need a CUDA GPU; without one run --check-only (Triton's interpreter)", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    device = torch.device("cuda" if on_gpu else "cpu")
    results: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)"}
    t0 = time.perf_counter()
    results["checks"] = rows = checks(device, on_gpu, args.seed)
    print(f"(a) correctness on {results['device']} ({time.perf_counter() - t0:.1f} s)")
    print(table(rows, [("check", "check", "s"), ("max_abs_err", "max |err|", ".2e"), ("tolerance", "tol", ".0e"),
                       ("ok", "ok", "")]))
    ok = all(r["ok"] for r in rows)
    if on_gpu and not args.check_only:
        dtype = getattr(torch, args.dtype)
        bw = copy_bandwidth(args.iters)
        results["copy_bandwidth_gb_s"] = bw / 1e9
        print(f"\n(b) device copy bandwidth: {bw / 1e9:.0f} GB/s (read + written, 1 GiB copy)")
        results["kernels"] = rows = kernel_timings(args, dtype, bw)
        print(table(rows, [("kernel", f"kernel ({args.dtype}, {args.model} shapes)", "s"), ("us", "us", ".1f"),
                           ("torch_us", "torch us", ".1f"), ("of_bound", "of HBM bound", ".0%")]))
        if not args.skip_model:
            results["decode_steps"] = rows = decode_steps(args, dtype, bw)
            mode = "CUDA graphs" if not args.no_graphs else "eager"
            print(f"\ndecode step of random:{args.model} ({args.dtype}, {mode}): forward + final norm + lm_head")
            print(table(rows, [("batch", "batch", "d"), ("context", "context", "d"), ("ms", "ms", ".2f"),
                               ("tokens_per_s", "tokens/s", ".0f"), ("gb_read", "GB read", ".2f"),
                               ("bound_ms", "bound ms", ".2f"), ("of_bound", "of HBM bound", ".0%")]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
