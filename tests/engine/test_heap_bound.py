"""The heap's freed memory is bounded: ``HeapBound`` gives it back past its limit, and prompt
logprobs no longer leave a larger block behind for every new prompt length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.cpu_kernels import HeapBound, keep_freed_memory, resident_bytes

pytestmark = pytest.mark.skipif(HeapBound.create() is None, reason="glibc's mallinfo2 and malloc_trim only")


def _heap_bytes() -> int:
    return HeapBound.create().info().arena


def freed_blocks_scenario() -> None:
    """The trim test's body, in a process of its own (see below)."""
    assert keep_freed_memory()  # as the engine runs: nothing is trimmed or unmapped on free
    bound = HeapBound.create(limit=16 << 20, every_s=60.0)
    blocks, pins = [], []
    for i in range(8):  # 4..11 MiB each, touched; a small block after each (kept) holds them mid-heap
        blocks.append(torch.ones(((4 + i) << 20) // 4))
        pins.append(torch.ones(16))
    resident = resident_bytes()
    del blocks
    assert bound.free_bytes() > 16 << 20
    assert resident_bytes() > resident - (16 << 20)  # freed, still resident
    assert bound.check(now=100.0) and bound.trims == 1
    assert resident_bytes() < resident - (40 << 20)  # of about 60 MiB freed
    assert not bound.check(now=130.0)  # within every_s of the last look
    assert not bound.check(now=160.0) and bound.trims == 1  # given back, still free: nothing new to give
    more = []
    for i in range(8):  # as much again, freed: the free bytes grow past the limit once more
        more.append(torch.ones(((4 + i) << 20) // 4))
        pins.append(torch.ones(16))
    del more
    assert bound.check(now=220.0) and bound.trims == 2


def test_freed_blocks_past_the_limit_go_back_to_the_os_and_the_check_waits_its_interval():
    """Run in a fresh interpreter: the resident size is the process's, and in the suite's process
    the garbage of earlier tests (collected by the cycle collector at any allocation) or their
    threads could give memory back between two readings (CI once saw 79 MB go)."""
    root = Path(__file__).resolve().parents[2]
    code = "from tests.engine.test_heap_bound import freed_blocks_scenario; freed_blocks_scenario()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


class _FakeLibc:
    """glibc's two calls, with the free bytes set by the test."""

    def __init__(self):
        self.free = 0
        self.trims = 0

    def mallinfo2(self):
        return SimpleNamespace(fordblks=self.free)

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


def test_the_bound_trims_on_growth_of_the_free_bytes_not_at_every_look_once_past_it():
    """Blocks given back stay free blocks in glibc's count: a bound on the total, once passed, trimmed
    at every look and handed back the pages the last steps' activations had just faulted in."""
    libc = _FakeLibc()
    bound = HeapBound(libc, limit=100, every_s=0.0)
    looks = [(50, 0), (150, 1), (150, 1), (150, 1), (60, 1), (150, 1), (170, 2), (170, 2), (300, 3)]
    for t, (free, trims) in enumerate(looks):
        libc.free = free
        bound.check(now=float(t))
        assert libc.trims == trims, (t, free)
    # 60 -> 150: taken out of the trimmed blocks and freed again (faulted in) counts; 60 -> 170 passes the limit


def test_the_engine_checks_its_heap_after_steps(make_engine):
    engine = make_engine()
    assert engine.heap is not None
    libc = _FakeLibc()
    engine.heap = HeapBound(libc, limit=0, every_s=0.0)
    engine.add_request("a", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3))
    steps = 0
    while engine.has_unfinished():
        libc.free += 1  # a byte more free at every look: over the limit (0) each time
        engine.step()
        steps += 1
    assert steps >= 3 and libc.trims == steps


def test_prompt_logprobs_of_growing_prompts_do_not_grow_the_heap_by_their_sum(make_engine):
    """Each prompt's logits were one block of its rows x the vocabulary; the heap kept each (a
    little larger than the last, so never reused): 64..640-token prompts grew it by 0.7 GB."""
    engine = make_engine(num_kv_blocks=128, max_num_batched_tokens=1024)
    engine.heap = None  # the slicing alone
    engine.add_request("warm", list(range(100, 164)), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    start = _heap_bytes()
    for i, n in enumerate(range(64, 704, 64)):
        engine.add_request(str(i), [100 + (j * 7 + i) % 30000 for j in range(n)],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        while engine.has_unfinished():
            engine.step()
    assert _heap_bytes() - start < 256 << 20
