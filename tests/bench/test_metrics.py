"""Benchmark metric definitions on constructed timings."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, goodput_rate, stats_ms, summarize


def rec(i, ttft=0.1, itl=(0.02, 0.02, 0.02), ok=True, out=None, error=None, start=0.0, warmup=False):
    latency = None if ttft is None else ttft + sum(itl)
    tokens = (1 + len(itl)) if out is None else out
    return RequestRecord(index=i, start=start, input_tokens=10, requested_output_tokens=tokens, ok=ok,
                         error=error, ttft=ttft, latency=latency, itl=list(itl), output_tokens=tokens,
                         stream_chunks=tokens, usage_tokens=tokens, warmup=warmup)


def test_ttft_and_e2e_stats():
    s = summarize([rec(0, ttft=0.1), rec(1, ttft=0.3)], duration_s=2.0)
    assert s.ttft_ms["mean"] == pytest.approx(200.0)
    assert s.ttft_ms["median"] == pytest.approx(200.0)
    assert s.e2e_ms["mean"] == pytest.approx(260.0)
    assert s.ttft_ms["p99"] == pytest.approx(298.0)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = rec(0, ttft=0.5, itl=(0.1, 0.2, 0.3))  # 4 tokens, 0.6 s after the first
    assert r.tpot == pytest.approx(0.6 / 3)


def test_tpot_undefined_for_one_token_outputs():
    r = rec(0, ttft=0.5, itl=(), out=1)
    assert r.tpot is None
    s = summarize([r], duration_s=1.0)
    assert math.isnan(s.tpot_ms["mean"]) and s.ttft_ms["mean"] == pytest.approx(500.0)


def test_itl_pools_every_gap_of_every_request():
    s = summarize([rec(0, itl=(0.01, 0.03)), rec(1, itl=(0.02,))], duration_s=1.0)
    assert s.itl_ms["mean"] == pytest.approx(20.0)
    assert s.itl_ms["max"] == pytest.approx(30.0)


def test_throughputs_exclude_failures_and_warmup():
    records = [rec(0), rec(1), rec(2, ok=False, error="http_500", ttft=None, itl=()), rec(3, warmup=True)]
    s = summarize(records, duration_s=2.0)
    assert (s.completed, s.failed, s.errors) == (2, 1, {"http_500": 1})
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(4.0)  # 2 requests x 4 tokens / 2 s
    assert s.total_token_throughput == pytest.approx((20 + 8) / 2)


def test_goodput_counts_requests_meeting_every_slo():
    records = [rec(0, ttft=0.1), rec(1, ttft=0.9), rec(2, ttft=0.1, itl=(0.2, 0.2)), rec(3, ttft=0.2, itl=(), out=1),
               rec(4, ok=False, error="timeout", ttft=None, itl=())]
    slo = SLO(ttft_ms=500, tpot_ms=100)
    s = summarize(records, duration_s=2.0, slo=slo)
    # 0: meets both; 1: TTFT too slow; 2: TPOT 200 ms too slow; 3: one token, TPOT undefined, TTFT ok;
    # 4: failed.
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.slo_attainment == pytest.approx(2 / 5)


def test_goodput_edge_cases():
    assert summarize([], 1.0, SLO(ttft_ms=1)).goodput == 0.0
    assert math.isnan(summarize([], 1.0, SLO(ttft_ms=1)).slo_attainment)
    only_ttft = SLO(ttft_ms=150)
    assert only_ttft.met(rec(0, ttft=0.15)) and not only_ttft.met(rec(0, ttft=0.151))
    assert SLO(tpot_ms=20).met(rec(0, ttft=9.0, itl=(0.02, 0.02)))  # TTFT unconstrained
    assert summarize([rec(0)], 1.0, None).goodput is None


@pytest.mark.parametrize("spec,err", [(["ttft"], "ttft:MS"), (["e2e:5"], "ttft:MS"), (["ttft:x"], "number"),
                                      (["tpot:-1"], "positive")])
def test_slo_parse_errors(spec, err):
    with pytest.raises(ValueError, match=err):
        SLO.parse(spec)


def test_slo_parse():
    assert SLO.parse(["ttft:500", "tpot:50"]) == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert SLO.parse(None) is None


def test_goodput_rate_stops_at_the_first_miss():
    assert goodput_rate([1, 2, 4, 8], [1.0, 0.95, 0.5, 0.92]) == 2
    assert goodput_rate([4, 1, 2], [0.1, 1.0, 0.95]) == 2
    assert goodput_rate([1, 2], [0.5, 0.4]) is None
    assert goodput_rate([1, 2], [0.9, 0.9]) == 2


def test_stats_of_nothing_are_nan():
    assert all(math.isnan(v) for v in stats_ms([]).values())


def test_usage_mismatch_counted():
    r = rec(0)
    r.usage_tokens = r.stream_chunks + 1
    assert summarize([r, rec(1)], 1.0).usage_mismatches == 1


def test_prefix_hit_rate_is_cached_over_prompt_tokens_of_the_requests_that_say():
    a, b, silent = rec(0), rec(1), rec(2)
    a.cached_tokens, b.cached_tokens = 10, 0  # each of 10 prompt tokens; the third says nothing
    assert summarize([a, b, silent], 1.0).prefix_hit_rate == pytest.approx(0.5)
    assert summarize([silent], 1.0).prefix_hit_rate is None
