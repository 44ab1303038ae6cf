"""The load generator as a library (``pdserve bench`` and the scripts in benchmarks/ use it).

    outcome = asyncio.run(run_bench(BenchConfig(base_url=..., dataset_name="random"), SLO(ttft_ms=500)))
    paths = write_outputs(config, outcome)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.bench.config import BenchConfig
from pdserve.bench.http import HTTPClient
from pdserve.bench.metrics import SLO, goodput_rate, summarize
from pdserve.bench.report import inf_as_text, plot_attainment, plot_latency_cdfs, plot_timeline, write_json
from pdserve.bench.runner import Runner, RunResult, build_workload, server_model


@dataclass
class BenchOutcome:
    model: str
    runs: list[dict] = field(default_factory=list)  # {"rate", "summary", "records"} per rate
    goodput_rate: float | None = None
    interrupted: str | None = None  # why the run stopped early, when it did


async def run_bench(config: BenchConfig, slo: SLO | None = None, tokenizer=None,
                    outcome: BenchOutcome | None = None) -> BenchOutcome:
    """Run the workload once, or once per rate of ``config.rates``. Raises ServerUnreachable
    when the server does not answer at all; otherwise failures are counted in the records.

    Pass ``outcome`` to keep what was measured if the run is interrupted (Ctrl-C).
    """
    if tokenizer is None:
        from pdserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    outcome = outcome if outcome is not None else BenchOutcome("")
    async with HTTPClient(config.base_url, config.timeout_s) as client:
        outcome.model = config.model or await server_model(client)
        model = outcome.model
        for rate in config.rate_list() or [config.request_rate]:
            runner = Runner(config, client, model, tokenizer)
            try:
                result = await runner.run(build_workload(config, tokenizer), rate)
            except BaseException as e:  # Ctrl-C or a bug: keep what was measured
                outcome.interrupted = repr(e)
                result = RunResult(sorted(runner.records, key=lambda r: r.index),
                                   max(time.perf_counter() - runner.t0, 1e-9), rate)
                outcome.runs.append({"rate": rate, "records": result.records,
                                     "summary": summarize(result.records, result.duration_s, slo)})
                raise
            outcome.runs.append({"rate": rate, "records": result.records,
                                 "summary": summarize(result.records, result.duration_s, slo)})
    if config.rates and slo is not None:
        outcome.goodput_rate = goodput_rate([r["rate"] for r in outcome.runs],
                                            [r["summary"].slo_attainment for r in outcome.runs],
                                            config.attainment_target)
    return outcome


def write_outputs(config: BenchConfig, outcome: BenchOutcome, slo: SLO | None = None,
                  sections: dict | None = None) -> list[Path]:
    """The JSON of every request (with ``sections`` added at its top level) and the plots; returns the
    paths written."""
    out = Path(config.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = config.label or f"{config.dataset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = [out / f"{label}.json"]
    extra = {"model": outcome.model, "goodput_rate": outcome.goodput_rate, "interrupted": outcome.interrupted,
             "slo": asdict(slo) if slo else None, **(sections or {})}
    write_json(paths[0], inf_as_text(asdict(config)), outcome.runs, extra)
    for run in outcome.runs:
        suffix = "" if len(outcome.runs) == 1 else f"-rate{run['rate']:g}"
        title = f"{config.dataset_name} @ {run['rate']:g} req/s"
        paths.append(out / f"{label}{suffix}-latency.png")
        plot_latency_cdfs(run["records"], paths[-1], title)
        paths.append(out / f"{label}{suffix}-timeline.png")
        plot_timeline(run["records"], paths[-1], title)
    if len(outcome.runs) > 1:
        paths.append(out / f"{label}-attainment.png")
        plot_attainment(outcome.runs, paths[-1], config.attainment_target, outcome.goodput_rate,
                        f"{config.dataset_name}: SLO attainment vs request rate")
    return paths
