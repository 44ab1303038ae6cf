"""A prefill worker's gRPC surface (a real server in this process, the tiny model): it serves what
every worker serves and Prefill, and receives no KV: Reserve and PushKV answer UNIMPLEMENTED, as
for any RPC its role does not define (it used to subclass the decode worker and reserve blocks)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.prefill_worker.server import PrefillServicer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from tests.worker.serving import SAMPLING, generated, status_of, with_worker


def test_a_prefill_worker_receives_no_kv(make_engine):
    prompt = list(range(100, 140))

    async def body(stub):
        reserve = await status_of(stub.Reserve(pb.ReserveRequest(request_id="r", prompt_token_ids=prompt,
                                                                 sampling=SAMPLING)))
        push = await status_of(stub.PushKV(iter([pb.KVChunk(handle="r", commit=True)])))
        info = await stub.Info(pb.InfoRequest())
        return reserve, push, info.role, await generated(stub, "g", prompt)

    reserve, push, role, tokens = with_worker(make_engine(), PrefillServicer, body)
    assert (reserve, push) == (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNIMPLEMENTED)
    assert role == "prefill"
    assert len(tokens) == 4  # colocated Generate, the worker base's, still served


@pytest.mark.parametrize("rpc", ["Reserve", "PushKV"])
def test_the_prefill_servicer_defines_no_receiving_rpc(rpc):
    """Not inherited from anything but the generated base (whose methods answer UNIMPLEMENTED)."""
    assert getattr(PrefillServicer, rpc) is getattr(pb_grpc.WorkerServicer, rpc)


def test_a_prompt_the_engine_refuses_is_invalid_argument_naming_the_field(make_engine):
    """The engine validates inside the output stream (an async generator): the refusal still ends
    the call with INVALID_ARGUMENT and the field, not UNKNOWN."""
    import json

    from pdserve.worker.servicer import engine_layout

    engine = make_engine()

    async def body(stub):
        dest = pb.ReserveResponse(handle="x", layout=engine_layout(engine).to_proto(pb), backend="grpc",
                                  kv_address="127.0.0.1:9")
        call = stub.Prefill(pb.PrefillRequest(request_id="x", prompt_token_ids=[10**7], sampling=SAMPLING,
                                              destination=dest))
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return None, None

    code, details = with_worker(engine, PrefillServicer, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert json.loads(details)["field"] == "prompt"
