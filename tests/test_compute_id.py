"""Which workers contend for compute (pdserve/compute_id.py), as the router reads their WorkerInfo."""

from __future__ import annotations

import os

import pytest

from pdserve import compute_id
from pdserve.compute_id import Compute, contention, cpu_list, parse_cpu_list


@pytest.mark.parametrize("cpus, text", [({0}, "0"), ({0, 1}, "0-1"), ({0, 1, 2, 3, 8}, "0-3,8"),
                                        ({5, 1, 3}, "1,3,5"), (set(), "")])
def test_cpu_list_is_the_kernels_format_and_reads_back(cpus, text):
    assert cpu_list(cpus) == text
    assert parse_cpu_list(text) == frozenset(cpus)


def test_this_process_describes_its_affinity_and_threads():
    c = Compute.parse(compute_id.cpu_compute(3, host="h"))
    assert c == Compute("h", "cpu", frozenset(os.sched_getaffinity(0)), 3)
    assert Compute.parse(compute_id.cuda_compute("GPU-1", host="h")) == Compute("h", "cuda", "GPU-1")


@pytest.mark.parametrize("text", ["", "h", "h/cpu/0-1", "h/cpu/x/2", "h/cuda/", "h/tpu/0", "h/cpu/0-1/two"])
def test_an_unreadable_description_is_none_and_contends_with_nothing(text):
    assert Compute.parse(text) is None
    assert contention({"a": text, "b": "h/cpu/0-1/8"}) == {"a": frozenset(), "b": frozenset()}


def c(host: str, cpus: str, threads: int) -> str:
    return f"{host}/cpu/{cpus}/{threads}"


@pytest.mark.parametrize("computes, contends", [
    # five one-thread workers on the same two cores (this machine's benchmark cluster): all of them
    ({w: c("h", "0-1", 1) for w in "pabcd"}, {w: set("pabcd") - {w} for w in "pabcd"}),
    # two workers, one thread each, on two cores: each has a core
    ({"p": c("h", "0-1", 1), "d": c("h", "0-1", 1)}, {"p": set(), "d": set()}),
    # pinned to a core each (pd_goodput.py): never, whatever their threads
    ({"p": c("h", "0", 4), "d": c("h", "1", 4)}, {"p": set(), "d": set()}),
    # four threads each on four cores: oversubscribed
    ({"p": c("h", "0-3", 4), "d": c("h", "0-3", 4)}, {"p": {"d"}, "d": {"p"}}),
    # the same CPU ids on two hosts: never
    ({"p": c("h1", "0-1", 8), "d": c("h2", "0-1", 8)}, {"p": set(), "d": set()}),
    # a chain of overlapping sets is one group (6 threads on CPUs 0-3); only overlapping sets contend
    ({"a": c("h", "0-1", 2), "b": c("h", "1-2", 2), "x": c("h", "2-3", 2)},
     {"a": {"b"}, "b": {"a", "x"}, "x": {"b"}}),
    # GPUs: the same device on the same host only
    ({"p": "h/cuda/GPU-1", "d": "h/cuda/GPU-1", "e": "h/cuda/GPU-2", "f": "g/cuda/GPU-1"},
     {"p": {"d"}, "d": {"p"}, "e": set(), "f": set()}),
    # a GPU worker and a CPU worker on one host: different compute
    ({"p": "h/cuda/0", "d": c("h", "0-1", 4)}, {"p": set(), "d": set()}),
])
def test_contention(computes, contends):
    assert contention(computes) == {w: frozenset(s) for w, s in contends.items()}
