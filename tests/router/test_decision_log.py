"""The router's routing decisions as debug lines (``--log-level DEBUG``): what it knew of each candidate,
each one's cost-model seconds, and where the prompt was prefilled, for an operator asking "why there?"."""

from __future__ import annotations

import logging

from tests.router.conftest import MODEL, in_rotation, run
from tests.router.test_contention_routing import _Decode, _Prefill


def test_each_decision_is_logged_at_debug_with_what_the_router_knew(make_client, caplog):
    prefill, decode = _Prefill(), _Decode()
    workers = [in_rotation("prefill"), in_rotation("decode")]
    for w, stub in zip(workers, (prefill, decode)):
        w.stub = stub
    client = make_client(workers)
    with caplog.at_level(logging.DEBUG, logger="pdserve.router.dispatcher"):
        r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(100, 700)),
                                                      "max_tokens": 3}))
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "pdserve.router.dispatcher"]
    picks = [line for line in lines if ": route " in line]
    assert [line.split(": route ")[1].split(":")[0] for line in picks] == ["decode", "prefill"]
    decode_line, prefill_line = picks
    # The request, the prompt, the cheapest remote prefill (1.2 s: 600 tokens at the model's 500 tokens/s),
    # the choice, then each candidate's seconds and load.
    assert "600 prompt tokens, cheapest remote prefill 1.200 s -> decode-0; decode-0: " in decode_line
    assert "(inflight 0 / 0 tok, running 0, waiting 0 / 0 tok, prefill 0 tok/s, step 0.0 ms at 0.0" in decode_line
    assert "-> prefill-0; prefill-0: 1.200 s (inflight 0 / 0 tok" in prefill_line
    (where,) = [line for line in lines if ": prefill " in line]
    assert " prefill remote (here on decode-0 " in where and "through a prefill worker 1.2" in where
    request_id = where.split(":")[0].removeprefix("request ")
    assert request_id and all(line.startswith(f"request {request_id}: ") for line in picks)


def test_nothing_is_built_for_the_log_below_debug(make_client, caplog, monkeypatch):
    from pdserve.router import cost

    def fail(*args):
        raise AssertionError("described a decision with debug logging off")

    monkeypatch.setattr(cost, "describe_pick", fail)
    workers = [in_rotation("decode")]
    workers[0].stub = _Decode()
    client = make_client(workers)
    with caplog.at_level(logging.INFO, logger="pdserve.router.dispatcher"):
        r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}))
    assert r.status_code == 200, r.text
