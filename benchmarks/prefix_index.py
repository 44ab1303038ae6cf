"""The router's global prefix index (pdserve/router/prefix_index.py) at scale: memory per indexed
block, lookup latency, event-apply throughput, resync and drop costs.

    python benchmarks/prefix_index.py                          # 64 workers, 1M blocks, ~1 minute
    python benchmarks/prefix_index.py --blocks 100000 --lookups 5000

The index holds ``--blocks`` distinct block hashes as chains of 64 blocks (conversations), each
chain held by 2 of the ``--workers`` workers at random (one the whole chain,
the other a leading part of it), loaded the way the router loads a worker: one resync from its
full block list. Then:

  memory      the table's bytes (numpy nbytes) and what tracemalloc saw allocated, per indexed block
  lookup      ``PrefixIndex.lookup`` of a prompt of 4-64 blocks (a chain's prefix, sometimes with
              blocks nobody holds after it): p50 / p99 / p99.9 of single calls
  hashing     a prompt's keys from its token ids (16 per block): the engine's chained blake2b
  apply       KV events as workers publish them (one hash each, hex, stored / removed alternately)
  resync      one worker's entries replaced by its block list; drop: a worker leaving the rotation

Prints the table with the processor and its flags; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from pdserve.engine.cpu_isa import describe_cpu
from pdserve.router.prefix_index import PrefixIndex, prompt_keys
from pdserve.state.store import KVEventRecord

CHAIN = 64  # blocks per conversation


def build(workers: int, blocks: int, rng: np.random.Generator) -> tuple[PrefixIndex, np.ndarray, float, int]:
    """The index, the chains' keys ``[chains, CHAIN]``, the seconds the resyncs took, traced bytes."""
    chains = rng.integers(2, 2**64 - 1, size=(blocks // CHAIN, CHAIN), dtype=np.uint64)
    holders = np.stack([rng.integers(0, workers, len(chains)), rng.integers(0, workers, len(chains))], 1)
    held = rng.integers(CHAIN // 4, CHAIN + 1, size=holders.shape)  # the leading blocks each holder keeps
    held[:, 0] = CHAIN  # the first holder the whole chain: every block is indexed
    tracemalloc.start()
    start = time.perf_counter()
    index = PrefixIndex()
    for w in range(workers):
        parts = [chains[c, :held[c, j]] for j in range(2) for c in np.flatnonzero(holders[:, j] == w)]
        index.begin_resync(f"w{w}")
        index.finish_resync(f"w{w}", "epoch", 0, np.concatenate(parts) if parts else np.zeros(0, np.uint64))
    seconds = time.perf_counter() - start
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return index, chains, seconds, traced


def percentiles(ns: list[int]) -> tuple[float, float, float]:
    q = statistics.quantiles(ns, n=1000)
    return q[499] / 1e3, q[989] / 1e3, q[998] / 1e3


def time_lookups(index: PrefixIndex, chains: np.ndarray, n: int, rng: np.random.Generator) -> dict:
    prompts = []
    for _ in range(n):
        length = int(rng.integers(4, CHAIN + 1))
        keys = chains[rng.integers(len(chains)), :length].tolist()
        if rng.random() < 0.3:  # a new question after a known prefix: blocks nobody holds
            cut = int(rng.integers(1, length))
            keys[cut:] = [int(k) for k in rng.integers(2, 2**63, length - cut, dtype=np.uint64)]
        prompts.append(keys)
    ns, matched = [], 0
    for keys in prompts:
        t = time.perf_counter_ns()
        found = index.lookup(keys)
        ns.append(time.perf_counter_ns() - t)
        matched += bool(found)
    return {"p50_us": percentiles(ns)[0], "p99_us": percentiles(ns)[1], "p999_us": percentiles(ns)[2],
            "prompts_with_a_hit": matched / n}


def time_hashing(n: int, rng: np.random.Generator) -> dict:
    """A prompt's keys from its token ids: what the router computes before a lookup."""
    ns = []
    for _ in range(n):
        tokens = rng.integers(0, 49152, 16 * int(rng.integers(4, CHAIN + 1))).tolist()
        t = time.perf_counter_ns()
        prompt_keys(tokens, "fingerprint", 16)
        ns.append(time.perf_counter_ns() - t)
    p50, p99, p999 = percentiles(ns)
    return {"p50_us": p50, "p99_us": p99, "p999_us": p999}


def time_apply(index: PrefixIndex, n: int, rng: np.random.Generator) -> float:
    """Events per second through ``apply`` (worker w0, from its current seq)."""
    hashes = [rng.bytes(16).hex() for _ in range(n // 2)]
    events, seq = [], 0
    for h in hashes:
        for kind in ("stored", "removed"):
            seq += 1
            events.append(KVEventRecord("w0", kind, (h,), "epoch", seq))
    start = time.perf_counter()
    outcomes = {index.apply(e) for e in events}
    assert outcomes == {"applied"}, outcomes
    return len(events) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=64, help="workers in the index (at most 64; default 64)")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct indexed blocks (default 1M)")
    parser.add_argument("--lookups", type=int, default=20_000, help="lookups timed (default 20000)")
    parser.add_argument("--events", type=int, default=200_000, help="events applied (default 200000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random hashes and lookups (default 0)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    load_before = Path("/proc/loadavg").read_text().split()[0]  # other work on the machine skews the tails
    index, chains, build_s, traced = build(args.workers, args.blocks, rng)
    gc.collect()
    gc.freeze()  # as the router does once it is up
    blocks = index.num_blocks
    result = {
        "workers": args.workers, "blocks": blocks, "block_holdings": sum(index.workers().values()),
        "bytes_per_block": index.nbytes / blocks, "traced_bytes_per_block": traced / blocks,
        "load_s": build_s,
        "lookup": time_lookups(index, chains, args.lookups, rng),
        "hashing": time_hashing(max(args.lookups // 4, 100), rng),
        "apply_events_per_s": time_apply(index, args.events, rng),
    }
    start = time.perf_counter()
    keys = index.keys_of_worker("w1")
    index.begin_resync("w1")
    index.finish_resync("w1", "epoch2", 0, keys)
    result["resync_ms"], result["resync_blocks"] = (time.perf_counter() - start) * 1e3, len(keys)
    start = time.perf_counter()
    index.drop_worker("w2")
    result["drop_ms"] = (time.perf_counter() - start) * 1e3
    load_after = Path("/proc/loadavg").read_text().split()[0]
    print(f"CPU: {describe_cpu()}\nload average before: {load_before}, after: {load_after}")
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def table(r: dict) -> str:
    lk, hl = r["lookup"], r["hashing"]
    rows = [
        ("workers / distinct blocks / (block, worker) pairs", f"{r['workers']} / {r['blocks']:,} / "
                                                               f"{r['block_holdings']:,}"),
        ("memory per block: table (nbytes) / traced", f"{r['bytes_per_block']:.1f} B / "
                                                      f"{r['traced_bytes_per_block']:.1f} B"),
        ("load (64 resyncs from block lists)", f"{r['load_s']:.2f} s"),
        ("lookup, 4-64 blocks: p50 / p99 / p99.9", f"{lk['p50_us']:.1f} / {lk['p99_us']:.1f} / {lk['p999_us']:.1f} us"
                                                   f"  ({lk['prompts_with_a_hit']:.0%} of prompts hit)"),
        ("prompt hashing, 4-64 blocks: p50 / p99 / p99.9", f"{hl['p50_us']:.1f} / {hl['p99_us']:.1f} / "
                                                           f"{hl['p999_us']:.1f} us"),
        ("events applied (1 hash each)", f"{r['apply_events_per_s']:,.0f} /s"),
        (f"resync of one worker ({r['resync_blocks']:,} blocks)", f"{r['resync_ms']:.1f} ms"),
        ("drop of one worker", f"{r['drop_ms']:.1f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
