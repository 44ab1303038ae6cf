"""The global prefix index on its own: lookups, idempotent events, gaps, restarts, workers leaving,
growth; and against a reference: real block pools driven at random, their events replayed through a
lossy stream (gaps, duplicates, restarts, removals), the index compared with their real block lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefix_hash import block_hashes
from pdserve.router.prefix_index import MAX_WORKERS, PrefixIndex, key_of, keys_of, keys_of_packed, prompt_keys
from pdserve.state.store import KVEventRecord

FP, BS = "fingerprint", 4


def stored(worker: str, seq: int, hashes, epoch: str = "e1", kind: str = "stored") -> KVEventRecord:
    return KVEventRecord(worker, kind, tuple(h.hex() for h in hashes), epoch, seq)


def synced(index: PrefixIndex, worker: str, epoch: str = "e1", seq: int = 0, hashes=()) -> None:
    assert index.begin_resync(worker)
    assert index.finish_resync(worker, epoch, seq, keys_of(hashes)) == "applied"


PROMPT = list(range(1, 33))  # 8 blocks
HASHES = block_hashes(PROMPT, FP, BS)
KEYS = prompt_keys(PROMPT, FP, BS)


def test_lookup_gives_each_workers_leading_run_of_held_blocks():
    index = PrefixIndex()
    synced(index, "a", hashes=HASHES[:5])
    synced(index, "b", hashes=HASHES[:2] + HASHES[3:])  # a hole at block 2: its prefix ends there
    synced(index, "c", hashes=HASHES[1:])  # no first block: no prefix at all
    synced(index, "d", hashes=HASHES)
    assert index.lookup(KEYS) == {"a": 5, "b": 2, "d": 8}
    assert index.lookup(KEYS[:3]) == {"a": 3, "b": 2, "d": 3}
    assert index.lookup([]) == {} and index.lookup(prompt_keys(PROMPT, FP, BS, "other tenant")) == {}
    assert index.num_blocks == 8 and index.workers() == {"a": 5, "b": 7, "c": 7, "d": 8}


def test_events_are_idempotent_and_a_gap_resyncs_with_the_events_after_the_snapshot():
    index = PrefixIndex()
    synced(index, "a")
    assert index.apply(stored("a", 1, HASHES[:2])) == "applied"
    assert index.apply(stored("a", 1, HASHES[:2])) == "ignored"  # a duplicate
    assert index.apply(stored("a", 2, HASHES[2:3], kind="removed")) == "applied"  # held by nobody: no change
    assert index.lookup(KEYS) == {"a": 2} and index.num_blocks == 2
    assert index.apply(stored("a", 4, HASHES[3:4])) == "resync"  # seq 3 is missing
    assert index.apply(stored("a", 5, HASHES[1:2], kind="removed")) == "buffered"
    assert index.apply(stored("a", 6, HASHES[4:5])) == "buffered"
    # the snapshot as of seq 5 (blocks 0, 2 and 3 held: block 1 removed); seq 4 and 5 are in it
    assert index.finish_resync("a", "e1", 5, keys_of([HASHES[0], HASHES[2], HASHES[3]])) == "applied"
    assert index.lookup(KEYS) == {"a": 1} and sorted(index.keys_of_worker("a")) == sorted(
        KEYS[i] for i in (0, 2, 3, 4))
    assert index.resyncs == 2 and index.events_applied == 3


def test_a_restart_is_a_new_epoch_and_late_events_of_the_old_one_are_stale():
    index = PrefixIndex()
    synced(index, "a", hashes=HASHES[:4], seq=7)
    assert index.apply(stored("a", 1, HASHES[:1], epoch="e2")) == "applied"  # a fresh pool from its start
    assert index.lookup(KEYS) == {"a": 1}
    assert index.apply(stored("a", 8, HASHES[1:2], epoch="e1")) == "ignored"  # the old process, late
    assert index.apply(stored("a", 5, HASHES[1:2], epoch="e3")) == "resync"  # joined past its start
    assert index.finish_resync("a", "e3", 5, keys_of(HASHES[:3])) == "applied"
    assert index.lookup(KEYS) == {"a": 3}
    assert index.apply(stored("a", 2, HASHES[5:6], epoch="e2")) == "ignored"


def test_events_buffered_from_before_a_restart_are_dropped_by_the_resync():
    index = PrefixIndex()
    synced(index, "a", epoch="e1")
    index.begin_resync("a")
    assert index.apply(stored("a", 3, HASHES[:1], epoch="e1")) == "buffered"
    assert index.apply(stored("a", 2, HASHES[:2], epoch="e2")) == "buffered"
    assert index.finish_resync("a", "e2", 1, keys_of(HASHES[:1])) == "applied"
    assert index.lookup(KEYS) == {"a": 2} and index.events_ignored == 1


def test_a_gap_after_the_snapshot_asks_for_another_resync():
    index = PrefixIndex()
    synced(index, "a")
    index.begin_resync("a")
    for seq in (3, 5, 6):
        index.apply(stored("a", seq, HASHES[seq:seq + 1]))
    assert index.finish_resync("a", "e1", 3, keys_of(HASHES[:4])) == "resync"  # seq 4 never came
    assert not index.is_synced("a")
    assert index.finish_resync("a", "e1", 6, keys_of(HASHES[:7])) == "applied"
    assert index.lookup(KEYS) == {"a": 7}


def test_a_worker_leaving_drops_its_entries_at_once_and_frees_its_slot():
    index = PrefixIndex()
    synced(index, "a", hashes=HASHES)
    synced(index, "b", hashes=HASHES[:3])
    index.drop_worker("a")
    assert index.lookup(KEYS) == {"b": 3} and index.num_blocks == 3 and index.workers() == {"b": 3}
    assert index.apply(stored("a", 1, HASHES)) == "ignored"  # not tracked any more
    index.drop_worker("b")
    assert index.num_blocks == 0
    for i in range(MAX_WORKERS):
        assert index.begin_resync(f"w{i}")
    assert not index.begin_resync("one too many")


def test_cleared_forgets_every_block_of_that_worker_only():
    index = PrefixIndex()
    synced(index, "a", hashes=HASHES)
    synced(index, "b", hashes=HASHES[:2])
    assert index.apply(stored("a", 1, (), kind="cleared")) == "applied"
    assert index.lookup(KEYS) == {"b": 2} and index.workers() == {"a": 0, "b": 2}


def test_growth_and_rebuilds_keep_every_entry():
    rng = np.random.default_rng(1)
    index = PrefixIndex(capacity=16)
    hashes = [rng.bytes(16) for _ in range(20_000)]
    synced(index, "a", hashes=hashes[:15_000])
    assert index.apply(stored("a", 1, hashes[15_000:], kind="stored")) == "applied"  # one at a time
    assert index.apply(stored("a", 2, hashes[:10_000], kind="removed")) == "applied"
    synced(index, "b", hashes=hashes[5_000:12_000])
    assert index.num_blocks == 15_000 and index.workers() == {"a": 10_000, "b": 7_000}
    assert np.array_equal(index.keys_of_worker("a"), np.sort(keys_of(hashes[10_000:])))
    assert index.nbytes / index.num_blocks <= 64
    assert index.lookup([key_of(h) for h in hashes[11_998:12_003]]) == {"a": 5, "b": 2}


def test_keys_are_the_first_eight_bytes_and_never_zero():
    h = bytes(8) + bytes(range(8))
    assert key_of(h) == 1 and keys_of_packed(h + HASHES[0]).tolist() == [1, key_of(HASHES[0])]
    index = PrefixIndex()
    synced(index, "a", hashes=[h])
    assert index.lookup([1]) == {"a": 1}


# ---- against real block pools ---------------------------------------------------------------------


class SimWorker:
    """A worker's cache manager (a real BlockPool) serving random prompts of shared prefixes."""

    def __init__(self, worker_id: str, rng: random.Random, num_blocks: int = 24):
        self.worker_id, self.rng, self.num_blocks = worker_id, rng, num_blocks
        self.restart()

    def restart(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, BS, model_fingerprint=FP)
        self.active: list[Request] = []
        self.n = 0

    def step(self, prompts: list[list[int]]) -> None:
        if self.active and (self.rng.random() < 0.45 or len(self.active) > 4):
            self.kv.free(self.active.pop(self.rng.randrange(len(self.active))))
        elif not self.active and self.rng.random() < 0.03:
            assert self.kv.pool.reset_prefix_cache()  # a "cleared" event
        else:
            self.n += 1
            request = Request(f"r{self.n}", self.rng.choice(prompts), SamplingParams())
            hits = self.kv.get_computed_blocks(request)
            tokens = request.num_tokens - len(hits) * BS
            if self.kv.allocate_slots(request, tokens, hits) is not None:
                self.active.append(request)

    def events(self) -> list[KVEventRecord]:
        pool = self.kv.pool
        return [KVEventRecord(self.worker_id, e.kind, tuple(h.hex() for h in e.block_hashes), pool.events.epoch,
                              e.seq) for e in pool.events.drain()]

    def prefix_blocks(self, tokens: list[int]) -> int:
        n = 0
        for h in block_hashes(tokens, FP, BS):
            if self.kv.pool.get_cached_block(h) is None:
                break
            n += 1
        return n


def make_prompts(rng: random.Random) -> list[list[int]]:
    systems = [[rng.randrange(50_000) for _ in range(BS * rng.randint(1, 4))] for _ in range(4)]
    return [rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randint(1, 3 * BS))] for _ in range(40)]


@pytest.mark.parametrize("seed", range(6))
def test_the_index_follows_real_pools_through_a_lossy_stream(seed):
    rng = random.Random(seed)
    prompts = make_prompts(rng)
    workers = {f"w{i}": SimWorker(f"w{i}", rng) for i in range(4)}
    index = PrefixIndex(capacity=16)
    stream: list[KVEventRecord] = []
    pending: dict[str, int] = {}  # worker -> ticks until its snapshot arrives
    # A worker whose last events were lost (or that restarted and has sent nothing since) cannot be
    # told from one that is quiet until its next event shows the gap: no comparison meanwhile.
    unseen_tail = dict.fromkeys(workers, False)

    def resync_now(wid: str) -> str:
        snapshot = workers[wid].kv.pool.snapshot()  # the worker's block list now
        unseen_tail[wid] = False
        return index.finish_resync(wid, snapshot.epoch, snapshot.seq, keys_of(snapshot.block_hashes))

    for wid in workers:
        index.begin_resync(wid)
        pending[wid] = rng.randint(0, 3)  # the router joined late: every worker resyncs first
    for _ in range(400):
        for wid, w in workers.items():
            for _step in range(rng.randint(0, 3)):
                w.step(prompts)
            if rng.random() < 0.01:
                w.restart()  # same id, a new epoch, seq from 1
                unseen_tail[wid] = True
            for e in w.events():
                unseen_tail[wid] = rng.random() < 0.03
                if unseen_tail[wid]:
                    continue  # lost: a gap
                stream.append(e)
                if rng.random() < 0.05:
                    stream.append(e)  # delivered twice
        if rng.random() < 0.01 and (wid := rng.choice(sorted(workers))) not in pending:
            index.drop_worker(wid)  # left the rotation, and back: resync
            index.begin_resync(wid)
            pending[wid] = rng.randint(0, 3)
        take = rng.randint(0, len(stream))  # the consumer lags behind at random
        for e in stream[:take]:
            if index.apply(e) == "resync" and e.worker_id not in pending:
                pending[e.worker_id] = rng.randint(0, 3)
        del stream[:take]
        for wid, due in list(pending.items()):
            pending[wid] = due - 1
            if not due:
                del pending[wid]
                if resync_now(wid) == "resync":
                    pending[wid] = rng.randint(0, 3)
        if not stream and not pending and not any(unseen_tail.values()):
            check(index, workers, prompts)  # caught up: the index is the workers' real block lists
    for w in workers.values():  # the end: every event delivered once
        stream += w.events()
    for e in stream:
        if index.apply(e) == "resync":
            pending.setdefault(e.worker_id, 0)
    for wid in set(pending) | {wid for wid, unseen in unseen_tail.items() if unseen}:
        index.begin_resync(wid)
        assert resync_now(wid) == "applied"
    check(index, workers, prompts)
    assert index.resyncs > len(workers) and index.events_ignored > 0


def check(index: PrefixIndex, workers: dict[str, SimWorker], prompts: list[list[int]]) -> None:
    for wid, w in workers.items():
        real = np.sort(keys_of(w.kv.pool.snapshot().block_hashes))
        assert np.array_equal(index.keys_of_worker(wid), real), wid
    for tokens in prompts[:10]:
        expected = {wid: n for wid, w in workers.items() if (n := w.prefix_blocks(tokens))}
        assert index.lookup(prompt_keys(tokens, FP, BS)) == expected
    assert index.num_blocks == len(set().union(*(set(index.keys_of_worker(w).tolist()) for w in workers)))


def test_the_reference_exercises_every_kind_of_event():
    rng = random.Random(0)
    w, prompts = SimWorker("w", rng), make_prompts(random.Random(0))
    kinds = set()
    for _ in range(500):
        w.step(prompts)
        kinds |= {e.kind for e in w.events()}
    assert kinds == {"stored", "removed", "cleared"}
