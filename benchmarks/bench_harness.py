"""Is the load generator the bottleneck? ``pdserve bench`` against a timing-only mock server.

    python benchmarks/bench_harness.py

The mock (``python -m pdserve.bench.mock_server``: made-up tokens at a fixed rate, each
stamped with its send time, the first also with the request's arrival time) lets us compare
the harness's own TTFT with the server's: the difference is what the harness adds to what it
measures (its sending, the loopback, its reading). Target: one bench process drives >= 200
requests/s and >= 10,000 streamed tokens/s with that error under 1 ms.

Prints a table per load level, writes JSON and a PNG of the TTFT error CDF to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.api import run_bench
from pdserve.bench.config import BenchConfig
from pdserve.bench.mock_server import parse_stamps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mock(tokens_per_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_server", "--port", str(port),
                             "--tokens-per-s", str(tokens_per_s)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/v1/models", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("mock server did not start")


def ttft_errors(records) -> list[float]:
    """Harness TTFT minus server TTFT, per request, in ms."""
    out = []
    for r in records:
        if not r.ok or not r.text:
            continue
        received, sent = parse_stamps(r.text)
        if received is None or not sent:
            continue
        out.append((r.ttft - (sent[0] - received)) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100,200,300", help="request rates to try (default: 100,200,300)")
    p.add_argument("--tokens", type=int, default=50, help="tokens per request (default: 50)")
    p.add_argument("--tokens-per-s", type=float, default=1000.0, help="mock's tokens/s per stream (default: 1000)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per load level (default: 5)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    args = p.parse_args()
    proc, url = start_mock(args.tokens_per_s)
    rows = []
    try:
        for rate in (float(x) for x in args.rates.split(",")):
            config = BenchConfig(base_url=url, num_prompts=int(rate * args.seconds), request_rate=rate,
                                 random_input_len=32, random_output_len=args.tokens, save_text=True, progress=False,
                                 seed=1)
            import uvloop

            outcome = uvloop.run(run_bench(config))
            run = outcome.runs[0]
            s, errors = run["summary"], ttft_errors(run["records"])
            rows.append({"rate": rate, "req_s": s.request_throughput, "tok_s": s.output_throughput,
                         "failed": s.failed, "err_p50": float(np.percentile(errors, 50)),
                         "err_p99": float(np.percentile(errors, 99)), "err_max": float(np.max(errors)),
                         "errors": errors})
    finally:
        proc.terminate()
        proc.wait(10)
    print("offered req/s | achieved req/s | streamed tokens/s | failed | TTFT error p50 (ms) | p99 (ms) | max (ms)")
    print("--- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        print(f"{r['rate']:g} | {r['req_s']:.1f} | {r['tok_s']:.0f} | {r['failed']} | {r['err_p50']:.3f} | "
              f"{r['err_p99']:.3f} | {r['err_max']:.3f}")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_harness.json").write_text(json.dumps(rows))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in rows:
        xs = np.sort(r["errors"])
        ax.plot(xs, np.linspace(0, 1, len(xs)), label=f"{r['rate']:g} req/s, {r['tok_s']:.0f} tok/s")
    ax.axvline(1.0, ls="--", c="k", lw=1)
    ax.set_xlabel("harness TTFT - server TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "bench_harness.png", dpi=100)
    print(f"\nwrote {out / 'bench_harness.json'} and {out / 'bench_harness.png'}")


if __name__ == "__main__":
    main()
