"""The real scheduler, block pool and a tiny model: batching, chunking, preemption, abort, remote KV.

Every engine made through ``make_engine`` is leak-checked when its test ends.
"""

from __future__ import annotations

import random

import pytest

from pdserve.configs import ConfigError
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.request import RequestStatus
from tests.conftest import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, lo: int = 5, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def generate(engine, ps, params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    return run_to_completion(engine)


def test_token_budget_chunks_prefill_and_mixes_decodes(make_engine):
    engine = make_engine(max_num_batched_tokens=7)
    engine.add_request("short", [5, 6], GREEDY)
    engine.add_request("long", list(range(100, 130)), GREEDY)
    seen_mixed = False
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        assert sched.num_tokens <= 7
        sizes = {s.request.request_id: s.num_tokens for s in sched.scheduled}
        if sizes.get("short") == 1 and sizes.get("long", 0) > 1:
            seen_mixed = True
        engine._process(engine.scheduler.update(sched, engine.runner.execute(sched)))
    assert seen_mixed, "a decode never shared a step with a prefill chunk"


def test_prompt_share_prefills_waiting_prompts_one_after_the_other_with_decodes_on_top(make_engine):
    """``max_prefill_tokens``: prompt chunks take at most that many tokens of a step, the earliest prompt
    first (it finishes before a later one starts), decodes beside them within the whole budget; the
    outputs are those of an engine without the cap (batching, chunking and preemption as well)."""
    ps = prompts(5, lo=20, hi=40, seed=3)
    engine = make_engine(max_num_batched_tokens=64, max_prefill_tokens=24)
    engine.add_request("first", [7, 8, 9], GREEDY)
    engine.step()  # "first" decodes from now on
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, GREEDY)
    order, seen_beside = [], False
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        chunks = [s for s in sched.scheduled if s.num_tokens > 1]
        assert sum(s.num_tokens for s in chunks) <= 24
        assert sched.num_tokens <= 64
        seen_beside |= bool(chunks) and any(s.num_tokens == 1 for s in sched.scheduled)
        for s in chunks:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
        engine._process(engine.scheduler.update(sched, engine.runner.execute(sched)))
        begun = [r for r in engine.scheduler.requests.values() if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        assert len(begun) <= 1, "a later prompt began before an earlier one was prefilled"
    assert order == [f"r{i}" for i in range(5)]
    assert seen_beside, "no decode shared a step with a prompt chunk"
    alone = generate(make_engine(), ps)
    assert generate(make_engine(max_prefill_tokens=24), ps) == alone
    assert generate(make_engine(max_prefill_tokens=5, max_num_batched_tokens=9), ps) == alone
    tight = make_engine(num_kv_blocks=8, max_prefill_tokens=16)  # preempts, and recomputes within the share
    assert generate(tight, ps) == alone
    assert tight.scheduler.num_preemptions > 0
    with pytest.raises(ConfigError, match="max_prefill_tokens must be positive"):
        EngineConfig(max_prefill_tokens=0)


def test_cap_on_running_requests(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i, p in enumerate(prompts(5)):
        engine.add_request(f"r{i}", p, GREEDY)
    while engine.has_unfinished():
        engine.step()
        assert engine.scheduler.num_running <= 2


def test_outputs_do_not_depend_on_batching_chunking_or_preemption(make_engine):
    ps = prompts(6, seed=1)
    alone = {}
    for i, p in enumerate(ps):
        alone.update({f"r{i}": generate(make_engine(), [p])["r0"]})
    together = generate(make_engine(), ps)
    chunked = generate(make_engine(max_num_batched_tokens=7), ps)
    tight = make_engine(num_kv_blocks=12)  # 12 blocks of 16 tokens: forces preemptions
    preempted = generate(tight, ps)
    assert tight.scheduler.num_preemptions > 0
    assert together == alone
    assert chunked == alone
    assert preempted == alone


def test_prefix_cache_hits_and_salt(make_engine):
    engine = make_engine()
    shared = list(range(1000, 1040))  # 2.5 blocks
    engine.add_request("a", shared + [1, 2, 3], GREEDY)
    first = run_to_completion(engine)["a"]
    engine.add_request("b", shared + [1, 2, 3], GREEDY)
    engine.add_request("c", shared + [1, 2, 3], GREEDY, cache_salt="tenant-2")
    second = run_to_completion(engine)
    assert second["b"] == first and second["c"] == first
    stats = engine.stats()
    assert stats.prefix_cache_hits == 32  # "b" found two full blocks; "c" found none
    assert engine.scheduler.requests == {}


def test_abort_at_any_time(make_engine):
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=2)
    for i, p in enumerate(prompts(4, lo=20, hi=30)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()  # r0 mid-prefill, others waiting
    outs = engine.abort_request(["r0", "r3"])
    assert {o.request_id for o in outs} == {"r0", "r3"}
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    for _ in range(6):
        engine.step()
    engine.abort_request("r1")  # running, decoding
    assert engine.abort_request("missing") == []
    run_to_completion(engine)


def test_remote_kv_resumes_with_prompt_counted_as_computed(make_engine):
    """KV written from outside (here: copied from a colocated engine) gives the same tokens."""
    prompt = list(range(2000, 2037))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prefill = make_engine()  # plays the prefill worker: computes the prompt, samples one token
    prefill.add_request("x", prompt, params)
    first = prefill.step()[0].new_token_ids
    src = prefill.kv.block_ids("x")

    decode = make_engine()
    request = decode.make_request("x", prompt, params)
    dst = decode.reserve_remote_request(request)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and len(dst) == len(src)
    assert decode.step() == []  # nothing to run until the KV lands
    decode.runner.kv_cache[:, :, dst] = prefill.runner.kv_cache[:, :, src]
    prefill.abort_request("x")
    decode.finish_remote_kv("x", ok=True, output_token_ids=first)
    assert request.num_computed_tokens == len(prompt) and request.output_token_ids == first
    remote = first + run_to_completion(decode)["x"]  # the first token is not reported twice

    reference = make_engine()
    reference.add_request("x", prompt, params)
    assert remote == run_to_completion(reference)["x"]


def test_remote_kv_failure_recomputes_locally(make_engine):
    prompt = list(range(3000, 3021))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    decode = make_engine()
    request = decode.make_request("x", prompt, params)
    assert decode.reserve_remote_request(request) is not None
    decode.finish_remote_kv("x", ok=False)
    assert request.num_computed_tokens == 0
    recomputed = run_to_completion(decode)["x"]
    reference = make_engine()
    reference.add_request("x", prompt, params)
    assert recomputed == run_to_completion(reference)["x"]


def test_landed_remote_kv_holding_every_block_does_not_stall_the_engine(make_engine):
    """Two block-aligned prompts whose KV landed hold all four blocks, and each needs a fifth for
    its next token: nothing runs, so nothing frees a block. The last one gives its blocks back and
    recomputes (its first block still cached: a prefix hit on the KV that landed); both finish
    with the tokens colocated serving gives."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts_ = {"a": list(range(4000, 4032)), "b": list(range(5000, 5032))}  # 2 blocks of 16 each
    expected, landed = {}, {}
    for rid, prompt in prompts_.items():
        reference = make_engine()
        reference.add_request(rid, prompt, params)
        first_step = reference.step()  # the whole prompt in one step: its KV is what "lands"
        landed[rid] = reference.runner.kv_cache[:, :, reference.kv.block_ids(rid)[:2]].clone()
        expected[rid] = [t for out in first_step for t in out.new_token_ids]
        expected[rid] += run_to_completion(reference)[rid]
    decode = make_engine(num_kv_blocks=4)
    requests = {rid: decode.make_request(rid, prompt, params) for rid, prompt in prompts_.items()}
    for rid, request in requests.items():
        block_ids = decode.reserve_remote_request(request)
        assert block_ids is not None
        decode.runner.kv_cache[:, :, block_ids] = landed[rid]
    assert decode.kv.pool.num_free_blocks == 0
    for rid in prompts_:
        decode.finish_remote_kv(rid, ok=True, output_token_ids=expected[rid][:1])
    outputs = run_to_completion(decode, max_steps=200)
    assert requests["b"].num_preemptions == 1
    for rid in prompts_:
        assert expected[rid][:1] + outputs[rid] == expected[rid]


def test_reserve_refused_when_no_room(make_engine):
    engine = make_engine(num_kv_blocks=2)
    big = engine.make_request("big", list(range(100, 130)), GREEDY)  # 30 tokens + room: 2 blocks ok
    assert engine.reserve_remote_request(big) is not None
    other = engine.make_request("other", list(range(100, 110)), GREEDY)
    assert engine.reserve_remote_request(other) is None
    engine.abort_request("big")


def test_prefill_rate_is_measured_from_steps_computing_prompts(make_engine):
    """The load snapshot's prefill tokens/s (the routers' cost model reads it): none before a prompt
    is computed, none from decode steps or a short prompt, and the steps that computed prompts after."""
    from pdserve.engine.engine import PREFILL_RATE_MIN_TOKENS

    engine = make_engine()
    assert engine.stats().prefill_tokens_per_s == 0.0
    generate(engine, [list(range(100, 100 + PREFILL_RATE_MIN_TOKENS - 1))])  # a short prompt, then decodes
    assert engine.stats().prefill_tokens_per_s == 0.0
    generate(engine, [list(range(200, 200 + 3 * PREFILL_RATE_MIN_TOKENS))])
    steps = list(engine._prefill_steps)
    assert [n for n, _ in steps] == [3 * PREFILL_RATE_MIN_TOKENS]
    assert engine.stats().prefill_tokens_per_s == steps[0][0] / steps[0][1] > 0


def _with_priority(priority: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def test_priority_policy_admits_by_class_then_arrival(make_engine):
    order = {}
    for policy in ("fcfs", "priority"):
        engine = make_engine(max_num_seqs=1, scheduling_policy=policy)
        for rid, priority in (("flex", 2), ("default", 1), ("priority", 0), ("priority-later", 0)):
            engine.add_request(rid, list(range(100, 120)), _with_priority(priority, max_tokens=2))
        finished = []
        while engine.has_unfinished():
            finished += [out.request_id for out in engine.step() if out.finished]
        order[policy] = finished
    assert order["fcfs"] == ["flex", "default", "priority", "priority-later"]
    assert order["priority"] == ["priority", "priority-later", "default", "flex"]


def test_priority_policy_preempts_the_lowest_class_and_outputs_stay_exact(make_engine):
    """Three requests on too few blocks: under fcfs the latest admitted ('late', class 0) gives way;
    under priority the flex one (class 2) does, though admitted before it. Tokens equal each alone."""
    ps = {"early": list(range(1000, 1030)), "flex": list(range(2000, 2030)), "late": list(range(3000, 3030))}
    classes = {"early": 0, "flex": 2, "late": 0}
    alone = {}
    for rid, p in ps.items():
        reference = make_engine()
        reference.add_request(rid, p, _with_priority(classes[rid], max_tokens=40))
        alone[rid] = run_to_completion(reference)[rid]
    preemptions = {}
    for policy in ("fcfs", "priority"):
        engine = make_engine(num_kv_blocks=9, scheduling_policy=policy)  # 3 x (30 + 40) tokens need 15 blocks
        requests = {}
        for rid, p in ps.items():
            engine.add_request(rid, p, _with_priority(classes[rid], max_tokens=40))
            requests[rid] = engine.scheduler.requests[rid]
        assert run_to_completion(engine) == alone
        preemptions[policy] = {rid: r.num_preemptions for rid, r in requests.items()}
    assert preemptions["fcfs"]["late"] > 0
    assert preemptions["priority"]["flex"] > 0 and preemptions["priority"]["early"] == 0
    assert preemptions["priority"]["late"] <= preemptions["fcfs"]["late"]


def test_an_unknown_scheduling_policy_is_refused(make_engine):
    import pytest

    with pytest.raises(ValueError, match="scheduling_policy"):
        make_engine(scheduling_policy="lifo")


def test_priority_policy_ends_a_request_still_unstarted_at_its_start_bound(make_engine, monkeypatch):
    """Under priority a flex request waits for as long as requests of a higher class keep coming:
    given a start bound, it ends unstarted when the bound passes (finish reason queue_timeout,
    nothing computed, no block held). A request that started runs on past its bound; under fcfs
    (the work ahead bounds the wait) the bound is not applied."""
    import time

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    for policy in ("fcfs", "priority"):
        engine = make_engine(max_num_seqs=1, scheduling_policy=policy)
        engine.add(engine.make_request("running", list(range(100, 120)), _with_priority(0, max_tokens=30),
                                       start_within_s=5))
        engine.add(engine.make_request("flex", list(range(200, 220)), _with_priority(2, max_tokens=4),
                                       start_within_s=5))
        assert [o.request_id for o in engine.step()] == ["running"]  # it starts; flex waits behind it
        now[0] += 4.9
        assert not any(o.finished for o in engine.step())
        now[0] += 0.2  # flex's bound has passed, and "running"'s (started: not applied)
        ended = {o.request_id: o for o in engine.step() if o.finished}
        if policy == "priority":
            flex = ended.pop("flex")
            assert (flex.finish_reason, flex.new_token_ids, flex.num_output_tokens) == ("queue_timeout", [], 0)
            assert "flex" not in engine.scheduler.requests and not engine.kv.holds_blocks("flex")
            assert engine.scheduler.num_queue_timeouts == 1
        assert not ended
        tokens = run_to_completion(engine)
        assert len(tokens["running"]) == 30 - 3  # one token in each of the three steps above
        assert ("flex" in tokens) == (policy == "fcfs")


def test_the_measured_decode_step_counts_only_steps_without_a_prompt_token(make_engine):
    """The routers' decode-step term (router/cost.py step_s): steps that held a prompt chunk are left out."""
    engine = make_engine(max_num_batched_tokens=8)
    decode_only = []
    engine.step_observer = lambda sched, seconds: decode_only.append(
        all(s.start >= s.request.num_prompt_tokens for s in sched.scheduled))
    assert engine.decode_step() == (0.0, 0.0)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", list(range(100, 130)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    run_to_completion(engine)
    assert any(decode_only) and not all(decode_only)  # some steps mixed "a"'s decodes with "b"'s chunks
    assert len(engine._decode_steps) == sum(decode_only)
    seconds, seqs = engine.decode_step()
    assert seconds > 0 and 1 <= seqs <= 2
    assert (engine.stats().decode_step_s, engine.stats().decode_step_seqs) == (seconds, seqs)
