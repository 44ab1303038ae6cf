"""pdserve bench against a live pdserve: every workload and arrival kind, checked from both sides."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import matplotlib.image
import pytest

from pdserve.bench.api import run_bench, write_outputs
from pdserve.bench.config import BenchConfig
from pdserve.bench.metrics import SLO

pytestmark = pytest.mark.integration


def counter(url: str, name: str, labels: str = "") -> float:
    """The counter with exactly these labels; without ``labels``, its sum over every label set."""
    text = httpx.get(url + "/metrics").text
    if labels:
        m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def ok_requests(url: str, endpoint: str) -> float:
    return counter(url, "pdserve_router_requests_total", f'{{endpoint="{endpoint}",status="200"}}')


def run(served, tmp_path, **options):
    config = BenchConfig(base_url=served.base_url, result_dir=str(tmp_path), progress=False, label="t",
                         random_input_len=24, random_output_len=6, max_output_len=8, **options)
    return config, asyncio.run(run_bench(config, SLO(ttft_ms=60000, tpot_ms=60000)))


def assert_valid_png(path) -> None:
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0.01, f"{path} is blank"


@pytest.mark.parametrize(
    "options",
    [
        {"dataset_name": "random", "num_prompts": 6, "request_rate": 20.0},
        {"dataset_name": "random", "num_prompts": 6, "request_rate": 20.0, "burstiness": 0.3},
        {"dataset_name": "random", "num_prompts": 6, "request_rate": 20.0, "arrival": "constant"},
        {"dataset_name": "random", "num_prompts": 6, "max_concurrency": 2, "warmup_requests": 2},
        {"dataset_name": "random", "num_prompts": 40, "request_rate": 8.0, "duration": 1.0},
        {"dataset_name": "prefix", "num_prompts": 6, "prefix_num": 2, "prefix_len": 40, "suffix_len": 4},
        {"dataset_name": "conversational", "num_prompts": 4, "max_concurrency": 4},
        {"dataset_name": "chat", "num_prompts": 4, "chat_turns": 2, "chat_user_words": 6},
    ],
    ids=["poisson", "gamma", "constant", "closed-loop+warmup", "duration", "prefix", "conversational", "chat"],
)
def test_workloads_and_arrivals_match_the_server_counters(served, tmp_path, options):
    chat = options["dataset_name"] == "chat"
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    before_req = ok_requests(served.base_url, endpoint)
    before_tok = counter(served.base_url, "pdserve_router_generation_tokens_total")
    config, outcome = run(served, tmp_path, **options)
    (only,) = outcome.runs
    records, summary = only["records"], only["summary"]
    expected = options["num_prompts"] + options.get("warmup_requests", 0)
    if "duration" in options:
        assert 0 < len(records) < options["num_prompts"]  # stopped by time, not by count
    else:
        assert len(records) == expected
    assert summary.failed == 0 and summary.completed == len(records) - options.get("warmup_requests", 0)
    assert all(r.ok and r.ttft > 0 and r.latency >= r.ttft and r.output_tokens >= 1 for r in records)
    assert ok_requests(served.base_url, endpoint) - before_req == len(records)
    generated = counter(served.base_url, "pdserve_router_generation_tokens_total") - before_tok
    assert generated == sum(r.output_tokens for r in records)
    assert summary.slo_attainment == 1.0
    assert all(r.cached_tokens is not None for r in records)  # the router's usage.prompt_tokens_details
    measured = [r for r in records if not r.warmup]
    assert summary.prefix_hit_rate == sum(r.cached_tokens for r in measured) / sum(r.input_tokens for r in measured)
    paths = write_outputs(config, outcome)
    data = json.loads(paths[0].read_text())
    assert len(data["runs"][0]["records"]) == len(records)
    assert {"ttft", "tpot", "itl", "latency", "output_tokens", "usage_tokens", "start"} <= set(
        data["runs"][0]["records"][0])
    for png in paths[1:]:
        assert_valid_png(png)


def test_sweep_reports_attainment_and_goodput_rate(served, tmp_path):
    config, outcome = run(served, tmp_path, num_prompts=4, rates="5,10")
    assert [r["rate"] for r in outcome.runs] == [5.0, 10.0]
    assert outcome.goodput_rate == 10.0
    paths = write_outputs(config, outcome)
    assert any(p.name.endswith("attainment.png") for p in paths)
    for png in paths[1:]:
        assert_valid_png(png)


def test_cli_table_and_files(served, tmp_path):
    out = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "bench", "--base-url", served.base_url,
                          "--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "4",
                          "--result-dir", str(tmp_path), "--label", "cli", "--no-progress", "--goodput", "ttft:60000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Successful requests:" in out.stdout and "Median TTFT (ms):" in out.stdout
    assert (tmp_path / "cli.json").exists() and (tmp_path / "cli-latency.png").exists()
