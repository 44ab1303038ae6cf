"""What a worker computes on, and which workers compete for the same compute.

A worker announces its compute in ``WorkerInfo.compute`` as one string::

    host/cpu/0-3,8/2     a CPU worker: its host, the CPUs it may run on (its affinity), its threads
    host/cuda/GPU-8f3c   a GPU worker: its host, its device (the CUDA UUID, else the index)

The router reads them to know whether a remote prefill takes work off a decode worker's hardware
(what disaggregation is for) or only moves it to other processes on the same cores (router/cost.py,
``remote_interference_s``). Workers contend when they are on one host and:

- GPU: on the same device;
- CPU: their CPU sets overlap and the threads of every CPU worker on that host whose set overlaps
  are more than the CPUs those sets span (the cores are oversubscribed; workers pinned to disjoint
  cores, or few enough threads for the cores, each have their own).

Imported by the worker and the router alike: the standard library only (the router never imports torch).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def cpu_list(cpus: Iterable[int]) -> str:
    """``0-3,8``: sorted CPU ids as ranges (the kernel's cpulist format)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def parse_cpu_list(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def cpu_compute(threads: int | None = None, host: str | None = None) -> str:
    """This process's CPU compute: its host, affinity and ``threads`` (default: one per CPU it may use)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)  # macOS: all
    return f"{host or socket.gethostname()}/cpu/{cpu_list(cpus)}/{threads or len(cpus)}"


def cuda_compute(device: str, host: str | None = None) -> str:
    return f"{host or socket.gethostname()}/cuda/{device}"


@dataclass(frozen=True)
class Compute:
    host: str
    kind: str  # "cpu" | "cuda"
    units: frozenset[int] | str  # CPU ids, or the GPU device
    threads: int = 0

    @classmethod
    def parse(cls, text: str) -> Compute | None:
        """None for an empty or unreadable string (a worker of an older version: shares nothing)."""
        parts = text.split("/")
        try:
            if len(parts) == 4 and parts[1] == "cpu":
                return cls(parts[0], "cpu", parse_cpu_list(parts[2]), int(parts[3]))
            if len(parts) == 3 and parts[1] == "cuda" and parts[2]:
                return cls(parts[0], "cuda", parts[2])
        except ValueError:
            return None
        return None


def contention(computes: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """Worker id -> the other workers it contends with (module docstring), from each one's ``compute``.
    CPU workers are grouped by overlapping CPU sets on a host (transitively); in a group whose threads
    outnumber the CPUs it spans, workers whose sets overlap contend."""
    parsed = {w: c for w, text in computes.items() if (c := Compute.parse(text)) is not None}
    out: dict[str, set[str]] = {w: set() for w in computes}
    cpu = [w for w, c in parsed.items() if c.kind == "cpu"]
    group = {w: w for w in cpu}  # union-find over overlapping CPU sets

    def root(w: str) -> str:
        while group[w] != w:
            group[w] = group[group[w]]
            w = group[w]
        return w

    for i, w in enumerate(cpu):
        for v in cpu[:i]:
            a, b = parsed[w], parsed[v]
            if a.host == b.host and a.units & b.units:
                group[root(w)] = root(v)
    members: dict[str, list[str]] = {}
    for w in cpu:
        members.setdefault(root(w), []).append(w)
    for ws in members.values():
        span = frozenset().union(*(parsed[w].units for w in ws))
        if sum(parsed[w].threads for w in ws) <= len(span):
            continue
        for w in ws:
            out[w].update(v for v in ws if v != w and parsed[v].units & parsed[w].units)
    gpus = [w for w, c in parsed.items() if c.kind == "cuda"]
    for w in gpus:
        out[w].update(v for v in gpus if v != w and (parsed[v].host, parsed[v].units) ==
                      (parsed[w].host, parsed[w].units))
    return {w: frozenset(s) for w, s in out.items()}
