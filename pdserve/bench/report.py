"""Showing a benchmark's results: a terminal table, a JSON file, PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pdserve.bench.metrics import RequestRecord, Summary


def table(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{'=' * 12} {title} {'=' * 12}"]
    width = len(lines[0])

    def row(name: str, value) -> None:
        if isinstance(value, float):
            value = "n/a" if math.isnan(value) else f"{value:.2f}"
        lines.append(f"{name:<40}{value:>{max(10, width - 40)}}")

    row("Successful requests:", summary.completed)
    row("Failed requests:", summary.failed)
    for kind, count in sorted(summary.errors.items()):
        row(f"  {kind}:", count)
    row("Benchmark duration (s):", summary.duration_s)
    row("Total input tokens:", summary.input_tokens)
    row("Total generated tokens:", summary.output_tokens)
    row("Request throughput (req/s):", summary.request_throughput)
    row("Output token throughput (tok/s):", summary.output_throughput)
    row("Total token throughput (tok/s):", summary.total_token_throughput)
    if summary.goodput is not None:
        row("Request goodput (req/s):", summary.goodput)
        row("SLO attainment (%):", 100 * summary.slo_attainment)
    if summary.prefix_hit_rate is not None:
        row("Prefix cache hit rate (%):", 100 * summary.prefix_hit_rate)
    if summary.usage_mismatches:
        row("Streamed != reported tokens (requests):", summary.usage_mismatches)
    for name, stats in (("Time to First Token", summary.ttft_ms), ("Time per Output Token (excl. 1st token)",
                        summary.tpot_ms), ("Inter-token Latency", summary.itl_ms), ("End-to-end Latency",
                        summary.e2e_ms)):
        short = {"Time to First Token": "TTFT", "Inter-token Latency": "ITL", "End-to-end Latency": "E2EL"}.get(
            name, "TPOT")
        lines.append(f"{name:-^{width}}")
        for key, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", stats[key])
    lines.append("=" * width)
    return "\n".join(lines)


def sweep_table(rows: list[dict], goodput_rate: float | None, target: float) -> str:
    out = ["rate (req/s) | completed | req/s | output tok/s | TTFT p90 (ms) | TPOT p90 (ms) | SLO attainment",
           "--- | --- | --- | --- | --- | --- | ---"]
    for r in rows:
        s: Summary = r["summary"]
        att = "n/a" if s.slo_attainment is None else f"{100 * s.slo_attainment:.1f}%"
        out.append(f"{r['rate']:g} | {s.completed} | {s.request_throughput:.2f} | {s.output_throughput:.1f} | "
                   f"{s.ttft_ms['p90']:.1f} | {s.tpot_ms['p90']:.1f} | {att}")
    if goodput_rate is not None or any(r["summary"].slo_attainment is not None for r in rows):
        shown = "none" if goodput_rate is None else f"{goodput_rate:g} req/s"
        out.append(f"\ngoodput rate (highest rate with >= {100 * target:.0f}% SLO attainment): {shown}")
    return "\n".join(out)


def inf_as_text(value):
    """``value`` with each infinite float (a config's "no limit") as the text "inf", in nested dicts and
    lists too: the JSON of results stays standard JSON where it can."""
    if isinstance(value, dict):
        return {k: inf_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [inf_as_text(v) for v in value]
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def write_json(path: Path, config: dict, runs: list[dict], extra: dict | None = None) -> None:
    payload = {"config": config, "runs": [
        {"rate": r["rate"], "summary": r["summary"].to_dict(), "records": [x.to_dict() for x in r["records"]]}
        for r in runs], **(extra or {})}
    path.write_text(json.dumps(payload, indent=1, allow_nan=True))


def _token_times(records: list[RequestRecord]) -> list[float]:
    times = []
    for r in records:
        if r.ok and r.ttft is not None:
            t = r.start + r.ttft
            times.append(t)
            for gap in r.itl:
                t += gap
                times.append(t)
    return times


def plot_latency_cdfs(records: list[RequestRecord], path: Path, title: str) -> None:
    plt = _pyplot()
    ok = [r for r in records if r.ok and not r.warmup]
    series = [("TTFT", [r.ttft for r in ok if r.ttft is not None]),
              ("TPOT", [t for r in ok if (t := r.tpot) is not None]),
              ("ITL", [x for r in ok for x in r.itl]),
              ("end-to-end", [r.latency for r in ok if r.latency is not None])]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    for ax, (name, values) in zip(axes, series):
        if values:
            xs = np.sort(np.asarray(values) * 1e3)
            ax.plot(xs, np.linspace(0, 1, len(xs)))
            for q in (50, 90, 99):
                ax.axvline(np.percentile(xs, q), ls=":", lw=0.8, c="gray")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction")
    fig.suptitle(f"{title}: latency CDFs (dotted: p50, p90, p99)", fontsize=10)
    save_figure(fig, path)


def plot_timeline(records: list[RequestRecord], path: Path, title: str) -> None:
    plt = _pyplot()
    times = _token_times([r for r in records if not r.warmup])
    ok = [r for r in records if r.ok and not r.warmup and r.ttft is not None]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.4))
    if times:
        end = max(times)
        width = max(0.05, end / 60)  # about 60 bins, whatever the run's length
        counts, edges = np.histogram(times, bins=np.arange(0, end + width, width))
        a1.step(edges[:-1], counts / width, where="post")
    a1.set_xlabel("time since start (s)")
    a1.set_ylabel("output tokens/s")
    a1.grid(alpha=0.3)
    a2.scatter([r.start for r in ok], [r.ttft * 1e3 for r in ok], s=6, label="TTFT")
    a2.scatter([r.start for r in ok], [r.latency * 1e3 for r in ok], s=6, label="end-to-end")
    a2.set_xlabel("request sent at (s)")
    a2.set_ylabel("latency (ms)")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(f"{title}: throughput and latency over time", fontsize=10)
    save_figure(fig, path)


def plot_attainment(rows: list[dict], path: Path, target: float, goodput_rate: float | None, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    rates = [r["rate"] for r in rows]
    att = [100 * (r["summary"].slo_attainment or 0.0) for r in rows]
    ax.plot(rates, att, "o-", label="SLO attainment")
    ax.axhline(100 * target, ls="--", c="k", lw=1, label=f"{100 * target:.0f}% target")
    if goodput_rate is not None:
        ax.axvline(goodput_rate, ls=":", c="tab:green", label=f"goodput rate {goodput_rate:g} req/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def save_figure(fig, path, dpi: int = 100) -> None:
    """Lay the figure out, write it as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
