"""``benchmarks/sim_validate.py --resimulate``: a recorded validation run (the prefix-routing one on
an AMD EPYC, committed under docs/bench/sim_validate) simulated again from its JSON alone, no cluster."""

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "bench" / "sim_validate" / "prefix_48_epyc.json"


def test_a_recorded_run_is_simulated_again_against_its_measured_figures():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_validate.py"), "--resimulate", str(RECORDED)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    cells = re.findall(r"^(cache_aware|least_loaded) @ ([\d.]+) req/s$", out, re.M)
    assert cells == [(p, r) for p in ("cache_aware", "least_loaded") for r in ("0.2", "0.3", "0.4")]
    # cache_aware routes by the same policy code over a prefix index fed the same KV events as the real
    # router's: the simulated prefix hit rate is the measured one in every cell.
    hits = re.findall(r"^\| Prefix hit \(%\) \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) pp \|$", out, re.M)
    assert len(hits) == 6
    assert all(measured == simulated for measured, simulated, _ in hits[:3])
    summary = re.search(r"^within 10%: (.*)$", out, re.M).group(1)
    assert re.fullmatch(r"(TTFT|TPOT) p50 \(ms\) \d of 6, (TTFT|TPOT) p90 \(ms\) \d of 6, .* of 6", summary), summary


def test_the_profile_at_the_probes_speed_scales_every_step_and_no_transfer():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_validate import at_speed

    from pdserve.bench.latency_model import Profile, StepFeatures

    profile = Profile.load(ROOT / "docs" / "bench" / "sim_validate" / "profile_1thread_epyc.json")
    slower = at_speed(profile, 1.07)
    for f in (StepFeatures(1024, 1024 * 1025 // 2), StepFeatures(decode_seqs=4, decode_context=2048)):
        assert abs(slower.step_s(f) - 1.07 * profile.step_s(f)) < 1e-9
    assert slower.transfer == profile.transfer and slower.model == profile.model


def test_a_recorded_run_with_step_traces_is_simulated_again_with_profiles_fitted_to_them():
    """The Xeon run of the pd experiment, its workers' step traces committed beside it: each cell simulated
    with a profile fitted to the other cells' traces (leave one out), every time metric within 10%."""
    recorded = ROOT / "docs" / "bench" / "sim_validate" / "pd_8_xeon_traces" / "sim_validate.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_validate.py"), "--resimulate", str(recorded)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    speeds = re.findall(r"^the workers' own steps took (.*) the profile's time for them$", out, re.M)
    assert len(speeds) == 6 and all(re.fullmatch(r"[\d.]+x \((decode|prefill)\), [\d.]+x \(decode(#2)?\)", s)
                                    for s in speeds), speeds
    fitted = re.search(r"^within 10% with profiles fitted to the workers' steps in the other runs: (.*)$", out, re.M)
    assert fitted.group(1).startswith("TTFT p50 (ms) 6 of 6, TTFT p90 (ms) 6 of 6, TPOT p50 (ms) 6 of 6, "
                                      "TPOT p90 (ms) 6 of 6; "), fitted.group(1)


def test_what_shipping_costs_the_prefill_worker_moves_the_disaggregated_ttft_and_nothing_colocated():
    """The third Xeon pd run with its profile and with the same plus the measured export terms (its
    ``profile_with_export.json``): the disaggregated cells' simulated TTFT grows (the prefill worker's steps
    take longer), their measured TTFT was above it (the errors shrink), and colocated cells do not move."""
    base = ROOT / "docs" / "bench" / "sim_validate" / "pd_8_xeon_traces_3"

    def ttft_errors(profile: Path) -> dict[str, list[float]]:
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_validate.py"), "--resimulate",
                               str(base / "sim_validate.json"), "--profile", str(profile)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        tables = done.stdout.split("each run simulated")[0]
        errors: dict[str, list[float]] = {}
        for mode, block in re.findall(r"^(colocated|disaggregated) @ [\d.]+ req/s\n((?:.*\n)*?)\n", tables, re.M):
            ttft = re.findall(r"^\| TTFT p[59]0 \(ms\) \| [\d.]+ \| [\d.]+ \| ([+-][\d.]+) %", block, re.M)
            errors.setdefault(mode, []).extend(float(e) for e in ttft)
        return errors

    plain, shipping = ttft_errors(base / "sim_validate_profile.json"), ttft_errors(base / "profile_with_export.json")
    assert len(plain["disaggregated"]) == len(shipping["disaggregated"]) == 6
    assert len(plain["colocated"]) == 6 and plain["colocated"] == shipping["colocated"]
    assert all(p < s <= 0 for p, s in zip(plain["disaggregated"], shipping["disaggregated"], strict=True))


def test_the_measured_figures_interval_is_wide_where_a_percentile_sits_at_a_cliff():
    """A measured percentile of a few dozen requests has its own uncertainty: the bootstrap interval.
    Half the requests at ~200 ms (a cached prefix) and half at ~2,000 (none): the median can be either."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_validate import measured_interval, within

    def requests(ttfts):
        return [{"warmup": i == 0, "ttft_ms": [t, None], "tpot_ms": [50.0, None]} for i, t in enumerate(ttfts)]

    cliff = requests([9999.0] + [200.0 + i for i in range(24)] + [2000.0 + i for i in range(24)])
    lo, hi = measured_interval(cliff, "TTFT p50 (ms)")
    assert lo < 300 and hi > 1900  # the warm-up's 9999 is left out, both sides of the cliff are inside
    smooth = requests([0.0] + [1000.0 + 10 * i for i in range(48)])
    lo, hi = measured_interval(smooth, "TTFT p50 (ms)")
    assert 1150 < lo < 1240 < hi < 1330
    assert all(math.isnan(x) for x in measured_interval(requests([1.0, 2.0]), "TPOT p90 (ms)"))  # one request
    counts = within({"TTFT p50 (ms)": [25.0, 5.0], "inside: TTFT p50 (ms)": [0.0, 0.0]})
    assert counts == "TTFT p50 (ms) 1 of 2; within 10% or inside the measured 90% interval: TTFT p50 (ms) 2 of 2"
