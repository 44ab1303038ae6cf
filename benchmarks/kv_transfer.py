"""KV transfer speed of each backend on loopback, and what the transfer adds to TTFT.

    python benchmarks/kv_transfer.py

Part 1: the KV of 512-, 2048- and 8192-token prompts (SmolLM2's layout, float32) sent by each
backend (grpc: PushKV between two processes; torch: gloo point-to-point between two processes,
control over gRPC; local: in-process copies) into a real decode worker's reserved blocks, timed
from the first layer sent to the commit acknowledged; against a plain memcpy of the same bytes
and a raw TCP send of them over loopback, measured in the same run.

Part 2: for a 2048-token prompt, TTFT colocated (a decode worker prefills it) versus
disaggregated (reserve on the decode worker, prefill on a prefill worker that ships the KV layer
by layer while it computes); the router's path, driven directly over gRPC. Target: the
transfer adds at most 10% to TTFT.

Prints tables, writes JSON and a PNG to --result-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench.profile import timed_local_transfer, timed_transfer  # noqa: E402
from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready  # noqa: E402
from pdserve.kvtransfer.base import KVLayout  # noqa: E402
from pdserve.kvtransfer.grpc_backend import GrpcSender  # noqa: E402
from pdserve.kvtransfer.local import LocalHub  # noqa: E402
from pdserve.kvtransfer.receiver import KVReceiver  # noqa: E402
from pdserve.kvtransfer.torch_backend import TorchSender  # noqa: E402
from pdserve.proto.v1 import worker_pb2 as pb  # noqa: E402
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "smollm2-135m-instruct"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
GREEDY = pb.SamplingParams(temperature=0, top_p=1, max_tokens=2, ignore_eos=True, repetition_penalty=1)


def kv_layers(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    blocks = -(-tokens // BLOCK)
    per_block = KV_HEADS * BLOCK * HEAD_DIM
    return [(torch.randn(blocks, per_block), torch.randn(blocks, per_block)) for _ in range(LAYERS)]


def nbytes(layers) -> int:
    return sum(k.numel() * 4 + v.numel() * 4 for k, v in layers)


def memcpy_rate(layers) -> float:
    dst = [(torch.empty_like(k), torch.empty_like(v)) for k, v in layers]
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for (k, v), (dk, dv) in zip(layers, dst):
            dk.copy_(k)
            dv.copy_(v)
        best.append(time.perf_counter() - t)
    return nbytes(layers) / min(best)


def tcp_rate(layers) -> float:
    payload = b"".join(k.numpy().tobytes() + v.numpy().tobytes() for k, v in layers)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = bytearray(len(payload))

    def sink():
        conn, _ = server.accept()
        view, got = memoryview(received), 0
        while got < len(payload):
            got += conn.recv_into(view[got:], min(1 << 20, len(payload) - got))
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    t = time.perf_counter()
    client.sendall(payload)
    client.recv(1)
    elapsed = time.perf_counter() - t
    client.close()
    thread.join()
    server.close()
    return len(payload) / elapsed


async def reserve(stub, rid: str, tokens: int) -> pb.ReserveResponse:
    prompt = [1000 + (i % 30000) for i in range(tokens)]
    return await stub.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY,
                                                lease_ms=120_000))


async def send_remote(sender, stub, rid: str, tokens: int, layers) -> float:
    """One transfer into a decode worker's reserved blocks, as `pdserve profile` times it (the layers sent
    from a thread, as the prefill worker's export thread sends): seconds from open to the answer."""
    res = await reserve(stub, rid, tokens)
    try:
        return (await timed_transfer(sender, res, layers, tokens))[1]
    finally:
        await stub.Abort(pb.AbortRequest(request_ids=[rid]))


def send_local(tokens: int, layers) -> float:
    cache = torch.empty(LAYERS, 2, -(-tokens // BLOCK), KV_HEADS, BLOCK * HEAD_DIM)
    layout = KVLayout("bench", "float32", BLOCK, LAYERS, KV_HEADS, HEAD_DIM)
    hub = LocalHub()
    receiver = KVReceiver(cache, layout)
    hub.register("local://d", receiver)
    return timed_local_transfer(hub, "local://d", receiver, layout, layers, tokens, "x")[1]


async def part1(decode_grpc: str, decode_torch: str, sizes: list[int], reps: int) -> list[dict]:
    rows = []
    loop = asyncio.get_running_loop()
    grpc_sender = GrpcSender(loop)
    torch_sender = TorchSender(GrpcSender(loop), "bench-sender")
    async with grpc.aio.insecure_channel(decode_grpc) as c1, grpc.aio.insecure_channel(decode_torch) as c2:
        stub_grpc, stub_torch = pb_grpc.WorkerStub(c1), pb_grpc.WorkerStub(c2)
        await send_remote(torch_sender, stub_torch, "warm", 64, kv_layers(64))  # the process group is made once
        for tokens in sizes:
            layers = kv_layers(tokens)
            size = nbytes(layers)
            g = [await send_remote(grpc_sender, stub_grpc, f"g{tokens}-{i}", tokens, layers) for i in range(reps)]
            tt = [await send_remote(torch_sender, stub_torch, f"t{tokens}-{i}", tokens, layers) for i in range(reps)]
            lo = [send_local(tokens, layers) for _ in range(reps)]
            row = {"tokens": tokens, "mb": size / 1e6, "grpc": size / min(g), "torch": size / min(tt),
                   "local": size / min(lo), "memcpy": memcpy_rate(layers), "tcp": tcp_rate(layers)}
            rows.append(row)
    return rows


async def ttft(stub, request: pb.GenerateRequest) -> float:
    t = time.perf_counter()
    async for msg in stub.Generate(request):
        if msg.token_ids:
            return time.perf_counter() - t
    raise RuntimeError("no token")


async def part2(decode: str, prefill: str, tokens: int, reps: int) -> dict:
    colocated, disagg, transfer = [], [], []
    async with grpc.aio.insecure_channel(decode) as cd, grpc.aio.insecure_channel(prefill) as cp:
        d, p = pb_grpc.WorkerStub(cd), pb_grpc.WorkerStub(cp)
        for i in range(reps + 1):  # the first round warms up
            prompt = [1000 + ((i * 7919 + j) % 30000) for j in range(tokens)]  # no prefix reuse between rounds
            t0 = await ttft(d, pb.GenerateRequest(request_id=f"c{i}", prompt_token_ids=prompt, sampling=GREEDY))
            prompt = [2000 + ((i * 104729 + j) % 30000) for j in range(tokens)]
            t = time.perf_counter()
            res = await d.Reserve(pb.ReserveRequest(request_id=f"d{i}", prompt_token_ids=prompt, sampling=GREEDY))
            first = done = None
            async for msg in p.Prefill(pb.PrefillRequest(request_id=f"d{i}", prompt_token_ids=prompt, sampling=GREEDY,
                                                         destination=res)):
                if msg.HasField("first"):
                    first = time.perf_counter() - t
                if msg.transfer_done:
                    done = time.perf_counter() - t
                    assert msg.transfer_ok, msg.transfer_error
            async for _ in d.Generate(pb.GenerateRequest(request_id=f"d{i}", prompt_token_ids=prompt, sampling=GREEDY,
                                                         kv_handle=res.handle, output_token_ids=[1])):
                pass
            if i:
                colocated.append(t0)
                disagg.append(first)
                transfer.append(done)
    c, dd, tr = statistics.median(colocated), statistics.median(disagg), statistics.median(transfer)
    return {"tokens": tokens, "colocated_ttft_s": c, "disagg_ttft_s": dd, "transfer_done_s": tr,
            "added_ttft_pct": 100 * (dd - c) / c, "runs": reps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,2048,8190",
                   help="prompt lengths in tokens (default: 512,2048,8190: SmolLM2's context is 8192)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each transfer, best taken (default: 3)")
    p.add_argument("--ttft-reps", type=int, default=5, help="rounds in part 2, median taken (default: 5)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    common = ["--port", "0", "--model", MODEL, "--no-load-progress", "--num-threads", "1", "--kv-cache-memory-gb", "1",
              "--max-num-batched-tokens", "2048"]
    workers = [start_worker("decode", common), start_worker("decode", [*common, "--kv-backend", "torch"]),
               start_worker("prefill", common)]
    try:
        wait_ready(workers, timeout_s=300)
        rows = asyncio.run(part1(workers[0].address, workers[1].address, sizes, args.reps))
        ttft_row = asyncio.run(part2(workers[0].address, workers[2].address, 2048, args.ttft_reps))
    finally:
        stop_workers(workers, grace_s=10)
    print("\nPart 1: KV bytes per second on loopback (best of", args.reps, ")")
    print("prompt tokens | KV MB | grpc MB/s | torch (gloo) MB/s | local MB/s | memcpy MB/s | raw TCP MB/s "
          "| grpc / TCP")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        print(f"{r['tokens']} | {r['mb']:.1f} | {r['grpc'] / 1e6:.0f} | {r['torch'] / 1e6:.0f} | "
              f"{r['local'] / 1e6:.0f} | {r['memcpy'] / 1e6:.0f} | {r['tcp'] / 1e6:.0f} | {r['grpc'] / r['tcp']:.2f}")
    t = ttft_row
    print(f"\nPart 2: 2048-token prompt, median of {t['runs']} (1 thread per worker)")
    print("colocated TTFT (s) | disaggregated TTFT (s) | added | transfer committed at (s)")
    print("--- | --- | --- | ---")
    print(f"{t['colocated_ttft_s']:.3f} | {t['disagg_ttft_s']:.3f} | {t['added_ttft_pct']:+.1f}% | "
          f"{t['transfer_done_s']:.3f}")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_transfer.json").write_text(json.dumps({"transfer": rows, "ttft": ttft_row}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for key, label in (("grpc", "grpc"), ("torch", "torch (gloo)"), ("local", "local"), ("memcpy", "memcpy"),
                       ("tcp", "raw TCP")):
        ax.plot([r["tokens"] for r in rows], [r[key] / 1e6 for r in rows], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("MB/s")
    ax.set_title("KV transfer rate on loopback")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "kv_transfer.png", dpi=100)
    print(f"\nwrote {out / 'kv_transfer.json'} and {out / 'kv_transfer.png'}")


if __name__ == "__main__":
    main()
