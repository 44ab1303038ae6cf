"""A decode worker's gRPC surface (a real server in this process, the tiny model): it serves what
every worker serves and the receiving side (Reserve, PushKV), and prefills for no one else: Prefill
answers UNIMPLEMENTED. Abort releases a reservation's blocks (the leak check at the end)."""

from __future__ import annotations

import os

import grpc

from pdserve.compute_id import Compute
from pdserve.decode_worker.server import DecodeServicer
from pdserve.proto.v1 import worker_pb2 as pb
from tests.worker.serving import SAMPLING, generated, status_of, with_worker


def test_a_decode_worker_reserves_and_does_not_prefill_for_others(make_engine):
    prompt = list(range(100, 140))

    async def body(stub):
        reserved = await stub.Reserve(pb.ReserveRequest(request_id="r", prompt_token_ids=prompt, sampling=SAMPLING))
        await stub.Abort(pb.AbortRequest(request_ids=["r"]))
        prefill = stub.Prefill(pb.PrefillRequest(request_id="p", prompt_token_ids=prompt, sampling=SAMPLING,
                                                 destination=reserved))
        prefill_status = await status_of(prefill.read())
        info = await stub.Info(pb.InfoRequest())
        return reserved, prefill_status, info, await generated(stub, "g", prompt)

    reserved, prefill_status, info, tokens = with_worker(make_engine(), DecodeServicer, body)
    role = info.role
    # what it computes on, for the router's contention map: this process's CPUs (pdserve/compute_id.py)
    assert Compute.parse(info.compute).units == frozenset(os.sched_getaffinity(0))
    assert reserved.handle == "r" and reserved.layout.num_layers > 0 and reserved.kv_address
    assert prefill_status == grpc.StatusCode.UNIMPLEMENTED
    assert role == "decode"
    assert len(tokens) == 4
