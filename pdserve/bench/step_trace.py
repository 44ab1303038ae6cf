"""Engine step traces: every step a serving worker's engine runs, what it computed and how long it took,
as JSON lines; and a latency profile fitted from them (`pdserve profile --from-trace`).

`pdserve profile` times the engine alone, on steps it designs. A worker in a cluster runs the same engine
beside its own server threads, the router, other workers and clients on the same machine; its steps take
what they take there. A trace records them, so that a profile can be fitted to the steps a real cluster
ran (the simulator then runs at the cluster's speed, not the engine's alone), and so that a run can be
checked against the profile it was simulated with, step by step.

A worker started with ``pdserve worker ROLE --step-trace PATH`` writes (``{pid}`` in PATH: its process id):

    {"pdserve_step_trace": 1, "role": ..., "worker_id": ..., "pid": ..., "started": ISO time, "model": {...},
     "hardware": {...}}
    [t, seconds, prefill_tokens, prefill_pairs, decode_seqs, decode_context]
    ...

one array per step: ``t`` the step's end in seconds since the trace began, ``seconds`` its time from
schedule to outputs (``LLMEngine.step_observer``'s, as `pdserve profile` times a step), then the step's
features (``latency_model.StepFeatures``). ``model`` and ``hardware`` are a profile's (``profile.model_info``
and ``hardware_info``). Rows are written in batches from the engine's thread, and the rest when the
worker stops.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.bench.latency_model import Profile, StepFeatures, features_of

TRACE_VERSION = 1
FLUSH_ROWS = 256  # write after this many steps ...
FLUSH_S = 2.0  # ... or once a step ends this long after the last write


def trace_path(template: str, pid: int | None = None) -> Path:
    """``template`` with ``{pid}`` replaced by ``pid`` (default: this process's)."""
    return Path(template.replace("{pid}", str(os.getpid() if pid is None else pid)))


class StepTraceWriter:
    """Writes an engine's steps to a trace file (a new file: one already there is replaced); ``observe`` is
    the engine's ``step_observer``."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")  # noqa: SIM115 (open until close(): its owner calls it after serving)
        self._file.write(json.dumps({"pdserve_step_trace": TRACE_VERSION, **header}) + "\n")
        self._file.flush()
        self._rows: list[str] = []
        self._lock = threading.Lock()  # observe runs in the engine's thread, close in the server's
        self._started = self._written = time.perf_counter()

    def observe(self, sched, seconds: float) -> None:
        f = features_of(sched.scheduled)
        now = time.perf_counter()
        row = (f"[{now - self._started:.4f},{seconds:.6f},{f.prefill_tokens},{f.prefill_pairs},{f.decode_seqs},"
               f"{f.decode_context}]")
        with self._lock:
            if self._file.closed:
                return
            self._rows.append(row)
            if len(self._rows) >= FLUSH_ROWS or now - self._written >= FLUSH_S:
                self._write(now)

    def _write(self, now: float) -> None:
        if self._rows:
            self._file.write("\n".join(self._rows) + "\n")
            self._file.flush()
            self._rows.clear()
        self._written = now

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._write(time.perf_counter())
                self._file.close()


def start_trace(engine, template: str, role: str, worker_id: str = "") -> StepTraceWriter:
    """A trace of ``engine``'s (an LLMEngine's) steps from now on, at ``template`` (see ``trace_path``): the
    engine's ``step_observer``. ``pdserve worker --step-trace`` starts one as it builds the engine and closes
    it when the worker stops."""
    from pdserve.bench.profile import hardware_info, model_info

    header = {"role": role, "worker_id": worker_id, "pid": os.getpid(),
              "started": datetime.now(UTC).isoformat(timespec="seconds"),
              "model": model_info(engine), "hardware": hardware_info(engine)}
    writer = StepTraceWriter(trace_path(template), header)
    engine.step_observer = writer.observe
    return writer


def traced_builder(build: Callable[[], Any], template: str, role: str,
                   worker_id: str = "") -> tuple[Callable[[], Any], Callable[[], None]]:
    """``build`` (an LLMEngine factory, called in the thread that will step the engine) wrapped to start the
    engine's trace at ``template`` as it builds it (no trace where ``template`` is empty), and what closes
    that trace (its steps not yet written), for the caller to call when the worker stops: what `pdserve
    worker --step-trace` and a Ray Serve worker replica (`pdserve serve --launcher ray --step-trace`) do."""
    traces: list[StepTraceWriter] = []

    def traced():
        engine = build()
        if template:
            traces.append(start_trace(engine, template, role, worker_id))
        return engine

    def close() -> None:
        for trace in traces:
            trace.close()

    return traced, close


def read_trace(path: str | Path) -> tuple[dict, list[tuple[float, float, StepFeatures]]]:
    """A trace's header and its steps as (t, seconds, features); a file that is not a trace is refused with
    what was wrong. A last line cut short (a worker killed mid-write) is skipped."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"step trace {path}: {e.strerror or e}") from e
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        header = {}
    if not isinstance(header, dict) or "pdserve_step_trace" not in header:
        raise ValueError(f"{path}: not a pdserve step trace (its first line is no trace header)")
    if header["pdserve_step_trace"] != TRACE_VERSION:
        raise ValueError(f"{path}: step trace version {header['pdserve_step_trace']!r}; this pdserve reads "
                         f"version {TRACE_VERSION}")
    steps = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            t, seconds, *counts = json.loads(line)
            steps.append((float(t), float(seconds), StepFeatures(*(int(c) for c in counts))))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a step row ({e})") from e
    return header, steps


def profile_from_traces(paths: list[str | Path], transfer_from: Profile | None = None, seed: int = 0,
                        skip_s: float = 0.0, transfer_source: str = "another profile") -> tuple[Profile, list]:
    """A measured profile fitted to the steps of the traces (``profile.fit_with_holdout``), with the model
    and hardware of the first trace's header (the traces must be of one model), and the KV transfer models
    and request overhead of ``transfer_from`` (a trace holds neither; ``transfer_source`` names it).
    ``skip_s``: each trace's steps that ended in its first seconds left out (a worker's first steps build
    oneDNN's kernels). A prefill worker's traced steps already took what shipping their KV added to them, so
    the transfer models come without ``transfer_from``'s export terms (``TransferModel.export_step_*``): the
    fit holds the cluster's steps as they ran. (Taking the terms off a prefill worker's steps before the fit,
    for the simulator to add back to the steps that ship, fitted the three Xeon runs of the pd experiment no
    better: README, "Simulating a cluster".) Returns the profile and the samples."""
    from pdserve.bench.profile import StepSample, _now, fit_with_holdout

    if not paths:
        raise ValueError("fitting a profile from traces needs at least one trace")
    headers, samples = [], []
    for path in paths:
        header, steps = read_trace(path)
        headers.append(header)
        samples += [StepSample(f, seconds, "trace") for t, seconds, f in steps if t >= skip_s]
    names = {h["model"].get("name") for h in headers}
    if len(names) > 1:
        raise ValueError(f"the traces are of different models ({sorted(map(str, names))}); fit one model at a time")
    step, fit = fit_with_holdout(samples, seed)
    fit.update(source={"traces": [str(p) for p in paths], "roles": sorted({h.get("role", "?") for h in headers}),
                       "skip_s": skip_s},
               note="steps of serving workers (their --step-trace), timed from schedule to outputs; holdout: "
                    "the same fit on 80% of the steps, predicting the other 20%")
    transfer = {k: dataclasses.replace(t, export_step_overhead_s=0.0, export_step_s_per_byte=0.0)
                for k, t in (transfer_from.transfer if transfer_from is not None else {}).items()}
    if transfer_from is not None:
        fit["transfer"] = {k: f"from {transfer_source}" for k in transfer}
    overhead = transfer_from.request_overhead_s if transfer_from is not None else 0.0
    if overhead:
        fit["request_overhead"] = {**transfer_from.fit.get("request_overhead", {}), "from": transfer_source}
    profile = Profile("measured", dict(headers[0]["model"]), dict(headers[0]["hardware"]), step, transfer, fit,
                      _now(), request_overhead_s=overhead)
    return profile, samples


def speed_against(profile: Profile, steps: list[tuple[float, float, StepFeatures]]) -> float:
    """Measured over predicted seconds of ``steps`` (a trace's): 1.08 when they took 8% longer than the
    profile says."""
    predicted = sum(profile.step_s(f) for _, _, f in steps)
    return sum(s for _, s, _ in steps) / predicted if predicted else float("nan")
