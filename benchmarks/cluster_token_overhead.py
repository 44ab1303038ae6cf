"""What the cluster token (pdserve/cluster_token.py) costs a streamed call: a gRPC server in this
process streams ``--messages`` GenerateResponse messages, read through ``cluster_token.channel``
with the token set and without it, alternating, ``--rounds`` times each; prints microseconds per
message (median of the rounds) and the ratio. Loopback, one process: the figure is the client
interceptor's share of a stream, not a network's.

    python benchmarks/cluster_token_overhead.py [--messages 3000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import grpc

from pdserve import cluster_token
from pdserve.engine.cpu_isa import describe_cpu
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc


def server_class(messages: int):
    class Streamer(pb_grpc.WorkerServicer):
        async def Generate(self, request, context):
            msg = pb.GenerateResponse(token_ids=[1], text="x")
            for _ in range(messages):
                yield msg

    return Streamer


async def per_message_us(channel) -> float:
    start, n = time.perf_counter(), 0
    async for _ in pb_grpc.WorkerStub(channel).Generate(pb.GenerateRequest()):
        n += 1
    return (time.perf_counter() - start) / n * 1e6


async def main(args) -> None:
    os.environ[cluster_token.TOKEN_ENV] = "benchmark-token"
    server = grpc.aio.server(interceptors=cluster_token.server_interceptors("127.0.0.1"))
    pb_grpc.add_WorkerServicer_to_server(server_class(args.messages)(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    with_token = cluster_token.channel(address)
    del os.environ[cluster_token.TOKEN_ENV]
    # the same server without its check, for the channel without a token
    plain_server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(server_class(args.messages)(), plain_server)
    plain_port = plain_server.add_insecure_port("127.0.0.1:0")
    await plain_server.start()
    without = cluster_token.channel(f"127.0.0.1:{plain_port}")
    times = {"without token": [], "with token": []}
    for _ in range(args.rounds):
        times["without token"].append(await per_message_us(without))
        times["with token"].append(await per_message_us(with_token))
    await server.stop(0)
    await plain_server.stop(0)
    print(describe_cpu())
    print(f"{args.messages} streamed messages per call, {args.rounds} rounds each, alternating\n")
    print("| channel | us per message (median) | rounds |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.0f}' for v in values)} |")
    ratio = statistics.median(times["with token"]) / statistics.median(times["without token"])
    print(f"\nwith / without: {ratio:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=3000, help="messages per streamed call (default 3000)")
    parser.add_argument("--rounds", type=int, default=7, help="calls per channel, alternating (default 7)")
    asyncio.run(main(parser.parse_args()))
