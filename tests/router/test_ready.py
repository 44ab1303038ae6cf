"""/ready answers 200 only when a request sent now will be served: a decode worker is in rotation."""

from __future__ import annotations

from pdserve.router.pool import WorkerHandle
from tests.router.conftest import in_rotation, run


def ready(client) -> tuple[int, dict]:
    r = run(client.get("/ready"))
    return r.status_code, r.json()


def test_a_prefill_worker_alone_is_not_ready(make_client):
    status, body = ready(make_client([in_rotation("prefill")]))
    assert status == 503 and body["ready"] is False
    assert "no decode worker in rotation" in body["reason"] and "1 prefill in rotation" in body["reason"]
    assert body["workers"] == [{"address": "127.0.0.1:17", "worker_id": "prefill-0", "role": "prefill",
                                "healthy": True, "compute": "", "contends_with": []}]


def test_ready_shows_what_each_worker_computes_on_and_whom_it_contends_with(make_client):
    """Two workers with two threads each on the same two CPUs contend (pdserve/compute_id.py)."""
    prefill, decode = in_rotation("prefill"), in_rotation("decode")
    prefill.info.compute = decode.info.compute = "h/cpu/0-1/2"
    _, body = ready(make_client([prefill, decode]))
    assert [(w["compute"], w["contends_with"]) for w in body["workers"]] == [
        ("h/cpu/0-1/2", ["decode-0"]), ("h/cpu/0-1/2", ["prefill-0"])]


def test_a_decode_worker_in_rotation_is_ready(make_client):
    starting = WorkerHandle("127.0.0.1:9")  # has not answered a poll yet
    status, body = ready(make_client([in_rotation("prefill"), starting, in_rotation("decode")]))
    assert status == 200 and body["ready"] is True
    assert [w["healthy"] for w in body["workers"]] == [True, False, True]


def test_no_worker_at_all_says_so(make_client):
    status, body = ready(make_client([WorkerHandle("127.0.0.1:9")]))
    assert status == 503 and "1 unknown out of rotation" in body["reason"]
    status, body = ready(make_client([]))
    assert status == 503 and "none known yet" in body["reason"]


class _Waker:
    """The waker's question, as cluster/ray_app.py PoolWaker answers it for a pool at zero replicas."""

    def can_wake(self, role: str) -> bool:
        return role == "decode"


def test_a_decode_pool_scaled_to_zero_is_ready(make_client):
    # A request wakes it and waits for its cold start; a 503 here would take the router out of a
    # Kubernetes Service, and then no request would ever wake the pool.
    status, body = ready(make_client([in_rotation("prefill")], waker=_Waker()))
    assert status == 200 and "scales from zero" in body["reason"]
