"""The latency model: features of a step, the least-squares fit, profiles as JSON, the roofline."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import pytest

from pdserve.bench.latency_model import (
    HARDWARE,
    PROFILE_VERSION,
    Profile,
    StepFeatures,
    StepModel,
    TransferModel,
    chunk_pairs,
    features_of,
    fit_step_model,
    kv_bytes_per_token,
    roofline,
)
from pdserve.engine.config import PRESETS


def test_chunk_pairs_count_what_causal_attention_computes():
    assert chunk_pairs(0, 1) == 1
    assert chunk_pairs(0, 4) == 1 + 2 + 3 + 4
    assert chunk_pairs(10, 2) == 11 + 12
    assert chunk_pairs(10, 3, window=4) == 4 * 3
    assert chunk_pairs(0, 6, window=4) == 1 + 2 + 3 + 4 + 4 + 4


def test_features_of_a_mixed_step():
    items = [SimpleNamespace(start=99, num_tokens=1), SimpleNamespace(start=9, num_tokens=1),
             SimpleNamespace(start=0, num_tokens=64), SimpleNamespace(start=64, num_tokens=32)]
    f = features_of(items)
    assert f == StepFeatures(prefill_tokens=96, prefill_pairs=chunk_pairs(0, 64) + chunk_pairs(64, 32),
                             decode_seqs=2, decode_context=100 + 10)


def test_the_fit_recovers_known_coefficients_from_noisy_steps():
    true = StepModel(0.01, 2e-4, 1e-8, 3e-3, 2e-6)
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        n = rng.choice([0, 16, 128, 512, 2048])
        b = rng.randint(0 if n else 1, 32)
        f = StepFeatures(n, chunk_pairs(rng.choice([0, 256]), n) if n else 0, b, b * rng.randint(16, 2048))
        samples.append((f, true.step_s(f) * rng.uniform(0.97, 1.03)))
    model, stats = fit_step_model(samples)
    for name in ("overhead_s", "per_prefill_token_s", "per_decode_seq_s", "per_decode_context_s"):
        assert getattr(model, name) == pytest.approx(getattr(true, name), rel=0.15), name
    assert stats["mean_abs_pct_error"] < 3 and stats["r2"] > 0.99 and stats["samples"] == 200


def test_the_fit_keeps_every_coefficient_non_negative():
    samples = [(StepFeatures(decode_seqs=b, decode_context=b * 100), 0.01 + 0.001 * b - 1e-7 * b * 100)
               for b in range(1, 20)]
    model, _ = fit_step_model(samples)
    assert all(v >= 0 for v in dataclasses.asdict(model).values())
    with pytest.raises(ValueError, match="at least 5 samples"):
        fit_step_model(samples[:3])


def test_a_profile_round_trips_and_another_version_is_refused(tmp_path):
    profile = Profile("measured", {"name": "m", "kv_bytes_per_token": 1024}, {"cpu": "x"},
                      StepModel(0.01, 1e-4, 1e-9, 1e-3, 1e-7), {"grpc": TransferModel(0.002, 1e-9)},
                      {"samples": 9})
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert profile.transfer_s(100, "grpc") == pytest.approx(0.002 + 1e-9 * 100 * 1024)
    with pytest.raises(KeyError, match="no transfer model for backend 'nccl'"):
        profile.transfer_s(100, "nccl")
    data = json.loads(path.read_text())
    data["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"version {PROFILE_VERSION + 1}"):
        Profile.load(path)
    with pytest.raises(ValueError, match="kind"):
        Profile("guessed", {"kv_bytes_per_token": 1}, {}, profile.step)


def test_what_shipping_adds_to_a_prefill_step_round_trips_and_older_profiles_have_none(tmp_path):
    profile = Profile("measured", {"name": "m", "kv_bytes_per_token": 1024}, {"cpu": "x"},
                      StepModel(0.01, 1e-4, 1e-9, 1e-3, 1e-7), {"grpc": TransferModel(0.002, 1e-9, 0.05, 2e-9)})
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile and profile.ships_with_cost("grpc")
    assert profile.export_step_s(1000, "grpc") == pytest.approx(0.05 + 2e-9 * 1000 * 1024)
    assert profile.export_step_s(0, "grpc") == 0 and profile.export_step_s(1000, "nccl") == 0
    data = json.loads(path.read_text())
    for key in ("export_step_overhead_s", "export_step_s_per_byte"):  # a profile written before they were
        del data["transfer"]["grpc"][key]
    older = Profile.from_json(data)
    assert older.export_step_s(1000, "grpc") == 0 and not older.ships_with_cost("grpc")


def test_a_roofline_profile_is_marked_modelled_and_orders_the_hardware():
    shape = dataclasses.asdict(PRESETS["llama-3-8b"])
    h100, l4 = roofline(HARDWARE["h100-sxm"], shape, "llama-3-8b"), roofline(HARDWARE["l4"], shape, "llama-3-8b")
    assert h100.kind == "modelled" and "modelled" in h100.fit["note"]
    assert h100.kv_bytes_per_token == kv_bytes_per_token(32, 8, 128, 2) == 131072
    prefill = StepFeatures(1024, chunk_pairs(0, 1024))
    decode = StepFeatures(decode_seqs=32, decode_context=32 * 1024)
    assert h100.step_s(prefill) < l4.step_s(prefill) and h100.step_s(decode) < l4.step_s(decode)
    # A decode step of Llama-3-8B in bf16 reads its 16 GB of weights: milliseconds on an H100.
    assert 0.005 < h100.step_s(StepFeatures(decode_seqs=1, decode_context=512)) < 0.05
    cost = h100.cost_model()
    assert cost.prefill_tokens_per_s > 1000 and cost.transfer_s_per_token > 0
