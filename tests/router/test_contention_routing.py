"""Conditional disaggregation knows when a prefill worker would only move work onto the decode
worker's own cores (pdserve/compute_id.py, router/cost.py ``remote_interference_s``). A Router in
this process over workers answering from a script (no model behind them)."""

from __future__ import annotations

import pytest

from pdserve.proto.v1 import worker_pb2 as pb
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run


def _tokens(*ids: int, finished: bool = False) -> pb.GenerateResponse:
    return pb.GenerateResponse(token_ids=list(ids), text="x" * len(ids), finished=finished,
                               finish_reason="length" if finished else "")


class _Decode:
    def __init__(self):
        self.prefilled_here = []

    def Generate(self, request):
        self.prefilled_here.append(request.prefill_here)
        return ScriptedCall([_tokens(7), _tokens(8, finished=True)])

    async def Reserve(self, request, timeout=None):
        return pb.ReserveResponse(handle=request.request_id, cached_tokens=0)

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


class _Prefill:
    def __init__(self):
        self.calls = 0

    def Prefill(self, request):
        self.calls += 1
        return ScriptedCall([pb.PrefillResponse(first=_tokens(6))])


@pytest.mark.parametrize("prefill_compute, decode_compute, config, remote", [
    ("", "", {}, True),  # workers that do not say (older ones): as before, each on hardware of its own
    ("h/cpu/0/1", "h/cpu/1/1", {}, True),  # pinned to a core each
    ("h/cpu/0-1/2", "h/cpu/0-1/2", {}, False),  # four threads on two cores
    ("h/cpu/0-1/2", "h/cpu/0-1/2", {"cost_contention": False}, True),  # the operator turned the term off
    ("h/cuda/GPU-1", "h/cuda/GPU-2", {}, True),
    ("h/cuda/GPU-1", "h/cuda/GPU-1", {}, False),
])
def test_a_cold_prompt_goes_to_the_prefill_worker_only_when_that_takes_work_off_the_decode_worker(
        make_client, prefill_compute, decode_compute, config, remote):
    """A 600-token prompt nobody has cached, an idle decode worker: prefilled remotely it costs the
    prefill (1.2 s at the model's 500 tokens/s) and the transfer, locally 1.2 s and the delay it adds
    to the decode batch. When both workers compute on the same oversubscribed cores or GPU, the
    remote prefill delays that batch as much, and the transfer is saved by staying local."""
    prefill, decode = _Prefill(), _Decode()
    workers = [in_rotation("prefill"), in_rotation("decode")]
    for w, stub, compute in zip(workers, (prefill, decode), (prefill_compute, decode_compute)):
        w.stub, w.info.compute = stub, compute
    client = make_client(workers, **config)
    r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(100, 700)), "max_tokens": 3}))
    assert r.status_code == 200, r.text
    assert prefill.calls == (1 if remote else 0)
    assert decode.prefilled_here == [not remote]
    decisions = run(client.get("/metrics")).text
    outcome = "remote" if remote else "local_faster"
    assert f'pdserve_router_prefill_decisions_total{{outcome="{outcome}"}} 1.0' in decisions
