"""Disaggregated serving over real processes: outputs identical to colocated serving, and
every fault (dropped, corrupt, stalled transfer; a prefill or decode worker killed) ends with
the right output, no leaked block, and the fault counted."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import pytest

from tests.integration.conftest import start_cluster, stop_cluster

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"
DISAGG = ["--disagg-min-prompt-tokens", "16", "--disagg-min-uncached-tokens", "8", "--no-cost-contention"]
ENGINE = ["--kv-cache-memory-gb", "0.25"]


def workload(n: int = 32, seed: int = 0) -> list[list[int]]:
    """Mixed lengths, half of them sharing a 48-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 40000) for _ in range(48)]
    out = []
    for i in range(n):
        own = [rng.randrange(1000, 40000) for _ in range(rng.randint(20, 160))]
        out.append(shared + own[:40] if i % 2 else own)
    return out


async def _complete(url: str, prompt: list[int], max_tokens: int, model: str = MODEL,
                    first: asyncio.Event | None = None) -> tuple[str, list[str]]:
    """Stream one completion; (text, chunks). ``first`` is set when its first chunk arrives."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks = []
    async with httpx.AsyncClient(timeout=300) as client, client.stream("POST", url + "/v1/completions",
                                                                       json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                chunks.extend(c["text"] for c in chunk["choices"] if c["text"])
                if first is not None:
                    first.set()
    return "".join(chunks), chunks


def run_all(url: str, prompts: list[list[int]], max_tokens: int = 16, model: str = MODEL) -> list[str]:
    async def main():
        return await asyncio.gather(*(_complete(url, p, max_tokens, model) for p in prompts))

    return [text for text, _ in asyncio.run(main())]


def no_leaks(cluster) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        stats = cluster.stats()
        if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks for s in stats):
            return
        time.sleep(0.2)
    pytest.fail(f"blocks or requests left behind: {stats}")


def router_counter(url: str, name: str, label: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


@pytest.fixture(scope="module")
def colocated_texts():
    cluster = start_cluster(MODEL, decode=2, engine_flags=ENGINE)
    try:
        texts = run_all(cluster.base_url, workload())
        no_leaks(cluster)
        return texts
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_32_concurrent_requests_identical_to_colocated(colocated_texts, backend):
    cluster = start_cluster(MODEL, decode=1, prefill=1, engine_flags=ENGINE, router_flags=DISAGG,
                            decode_flags=["--kv-backend", backend])
    try:
        assert run_all(cluster.base_url, workload()) == colocated_texts
        assert router_counter(cluster.base_url, "pdserve_router_prefill_decisions_total", 'outcome="remote"') >= 16
        assert cluster.worker_metric(1, "pdserve_kv_transfers_total") >= 16
        assert cluster.worker_metric(1, "pdserve_kv_transfer_failures_total") == 0
        no_leaks(cluster)
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("fault,reason,backend", [("drop:3", "incomplete", "grpc"), ("corrupt:5", "checksum", "grpc"),
                                                  ("stall:4", "lease_expired", "grpc"),
                                                  ("corrupt:2", "checksum", "torch")])
def test_transfer_faults_recompute_with_the_same_output(colocated_texts, fault, reason, backend):
    cluster = start_cluster(MODEL, decode=1, prefill=1, engine_flags=ENGINE, router_flags=DISAGG,
                            prefill_flags=["--kv-fault", fault],
                            decode_flags=["--kv-lease-ms", "1500", "--kv-backend", backend])
    try:
        prompts = workload()[:6]
        assert run_all(cluster.base_url, prompts) == colocated_texts[:6]
        assert cluster.worker_metric(1, f'pdserve_kv_transfer_failures_total{{reason="{reason}"}}') >= 1
        assert cluster.worker_metric(1, 'pdserve_kv_transfers_total{outcome="recomputed"}') >= 1
        no_leaks(cluster)
    finally:
        stop_cluster(cluster)


def test_prefill_worker_killed_mid_transfer(colocated_texts):
    # The prefill worker stalls before committing; it is killed while its transfers hang.
    cluster = start_cluster(MODEL, decode=1, prefill=1, engine_flags=ENGINE, router_flags=DISAGG,
                            prefill_flags=["--kv-fault", "stall:30"], decode_flags=["--kv-lease-ms", "20000"])
    try:
        prompts = workload()[:4]

        async def main():
            firsts = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(_complete(cluster.base_url, p, 16, first=e)) for p, e in zip(prompts, firsts)]
            # Every first token streamed: the prompts are computed, their transfers stalled before the commit.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            cluster.workers[0].process.send_signal(signal.SIGKILL)
            return [t for t, _ in await asyncio.wait_for(asyncio.gather(*tasks), 120)]

        assert asyncio.run(main()) == colocated_texts[:4]
        assert cluster.worker_metric(1, 'pdserve_kv_transfer_failures_total{reason="stream_broken"}') >= 1
        assert run_all(cluster.base_url, workload()[4:6]) == colocated_texts[4:6]  # served without it
        no_leaks(cluster)
    finally:
        stop_cluster(cluster)


def test_decode_worker_killed_mid_stream_continues_without_gap_or_repeat():
    reference = start_cluster(MODEL, decode=1, engine_flags=ENGINE)
    prompt = workload(1, seed=5)[0]
    try:
        expected = run_all(reference.base_url, [prompt], max_tokens=160)[0]
    finally:
        stop_cluster(reference)
    cluster = start_cluster(MODEL, decode=2, prefill=1, engine_flags=ENGINE, router_flags=DISAGG)
    try:
        async def main():
            task = asyncio.create_task(_complete(cluster.base_url, prompt, 160))
            deadline = time.monotonic() + 60
            victim = None
            while victim is None and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
                stats = cluster.stats()[1:]  # the decode workers
                busy = [i for i, s in enumerate(stats, start=1) if s.num_running > 0 and s.generation_tokens_total > 20]
                victim = busy[0] if busy else None
            assert victim is not None, "the request never ran"
            cluster.workers[victim].process.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(task, 120)

        text, chunks = asyncio.run(main())
        assert text == expected
        assert router_counter(cluster.base_url, "pdserve_router_migrations_total") >= 1
        assert router_counter(cluster.base_url, "pdserve_router_faults_total", 'reason="decode_worker_lost"') >= 1
    finally:
        stop_cluster(cluster)


def test_mismatched_prefill_worker_is_refused_at_the_handshake():
    import grpc

    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

    cluster = start_cluster(MODEL, decode=1, prefill=1, engine_flags=ENGINE, router_flags=DISAGG,
                            prefill_flags=["--block-size", "32"])
    try:
        decode = pb_grpc.WorkerStub(grpc.insecure_channel(cluster.workers[1].address))
        prefill = pb_grpc.WorkerStub(grpc.insecure_channel(cluster.workers[0].address))
        sampling = pb.SamplingParams(temperature=0, top_p=1, max_tokens=4, repetition_penalty=1)
        prompt = workload(1)[0]
        res = decode.Reserve(pb.ReserveRequest(request_id="m", prompt_token_ids=prompt, sampling=sampling))
        with pytest.raises(grpc.RpcError) as e:
            list(prefill.Prefill(pb.PrefillRequest(request_id="m", prompt_token_ids=prompt, sampling=sampling,
                                                   destination=res)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size: sender 32, receiver 16" in e.value.details()
        decode.Abort(pb.AbortRequest(request_ids=["m"]))
        # Through the router, the mismatched prefill worker is never paired: requests prefill locally.
        assert run_all(cluster.base_url, [prompt], 8)[0]
        assert router_counter(cluster.base_url, "pdserve_router_prefill_decisions_total", 'outcome="remote"') == 0 \
            or router_counter(cluster.base_url, "pdserve_router_faults_total", "no_prefill_worker") >= 1
        no_leaks(cluster)
    finally:
        stop_cluster(cluster)


def test_a_reservation_released_while_its_prompt_queues_still_completes(colocated_texts):
    """A prefill worker with a small token budget queues 32 prompts for seconds; the decode
    worker's reservations wait only 300 ms for their transfer to begin, so most are released
    before their KV comes. Those requests are computed on the decode worker: same outputs,
    none lost, counted as recomputed."""
    cluster = start_cluster(MODEL, decode=1, prefill=1, engine_flags=ENGINE, router_flags=DISAGG,
                            prefill_flags=["--max-num-batched-tokens", "32"],
                            decode_flags=["--kv-lease-ms", "300", "--kv-reservation-ttl-ms", "300"])
    try:
        assert run_all(cluster.base_url, workload()) == colocated_texts
        assert cluster.worker_metric(1, 'pdserve_kv_transfers_total{outcome="recomputed"}') >= 1
        assert cluster.worker_metric(1, 'pdserve_kv_transfer_failures_total{reason="never_resumed"}') >= 1
        no_leaks(cluster)
    finally:
        stop_cluster(cluster)


@pytest.mark.slow
def test_bfloat16_disaggregated_equals_colocated():
    """--dtype bfloat16 on every worker (it crashed them at start-up): the KV crosses as bfloat16
    bytes and the greedy output equals colocated bfloat16 serving. The tiny random-weight model
    keeps it quick; requests go one at a time, so both runs compute the same batches."""
    model, engine = "random:tiny", ["--dtype", "bfloat16", "--num-kv-blocks", "512"]
    prompts = workload(6, seed=3)

    def serve_each(cluster) -> list[str]:
        return [run_all(cluster.base_url, [p], 16, model)[0] for p in prompts]

    reference = start_cluster(model, decode=1, engine_flags=engine)
    try:
        expected = serve_each(reference)
    finally:
        stop_cluster(reference)
    cluster = start_cluster(model, decode=1, prefill=1, engine_flags=engine, router_flags=DISAGG)
    try:
        assert serve_each(cluster) == expected
        remote = router_counter(cluster.base_url, "pdserve_router_prefill_decisions_total", 'outcome="remote"')
        assert remote >= 4
        assert cluster.worker_metric(1, 'pdserve_kv_transfers_total{outcome="ok"}') == remote
        assert cluster.worker_metric(1, "pdserve_kv_transfer_failures_total") == 0
        no_leaks(cluster)
    finally:
        stop_cluster(cluster)
