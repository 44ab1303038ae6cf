"""What disaggregation adds to TTFT for prompts prefilled in several chunks.

    python benchmarks/pd_chunk_overlap.py                        # this checkout, 7-12 minutes on 2 cores
    git worktree add /tmp/wt-before 0ba9265                      # the commit before chunk-wise export
    python benchmarks/pd_chunk_overlap.py --tree /tmp/wt-before --tag before-r1 \
        --result-dir docs/bench/pd_chunk_overlap                 # measured: pdserve/prefill_worker/README.md

Three workers of the default model, one thread each, every one with a 512-token step budget
(--max-num-batched-tokens 512), so a 2048-token prompt is prefilled in 4 steps and an 8190-token
one in 16: a decode worker behind its own router (colocated: it prefills its prompts), and a
prefill worker plus a decode worker behind a second router (disaggregated: the KV crosses over
gRPC). The colocated decode worker and the prefill worker share core 0, the disaggregated
decode worker has core 1, as if prefill and decode had machines of their own. Requests go one
at a time through the routers' HTTP API, alternating colocated and disaggregated: each pair is
one fresh prompt sent to both setups (they share no worker, so no prefix-cache hit anywhere);
the medians of ``--reps`` pairs are reported (the added TTFT: the median of the pairs' own).

Measured at the client: TTFT (request sent to first token) and the time to the second token,
which a disaggregated request reaches only once its KV has landed on the decode worker. The
added TTFT of disaggregation is (disaggregated - colocated) / colocated; target <= 10%.

``--tree`` runs the workers and routers of another checkout (a git worktree of an older commit)
with this script, so two commits are compared by the same measurement; ``--tag`` names the run
(``before-r2``: the second run of family ``before``). Writes ``pd_chunk_overlap_<tag>.json`` to
--result-dir, then prints a table and draws ``pd_chunk_overlap.png`` over every run found there,
each family's runs pooled (medians over all their pairs: the machine may be shared, repeat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.engine.cpu_isa import describe_cpu

MODEL = "smollm2-135m-instruct"
BUDGET = 512


def pin(pid: int, core: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass


def fresh_prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


async def first_two_tokens(url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, time to the second token) in seconds, streaming one completion of two tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client, client.stream("POST", url + "/v1/completions",
                                                                       json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                times.extend(time.perf_counter() - t for c in chunk["choices"] if c["text"])
    assert len(times) >= 2, f"expected two tokens, got {len(times)}"
    return times[0], times[1]


def measure(colocated: str, disaggregated: str, tokens: int, reps: int, seed: int) -> dict:
    rows = []
    for i in range(reps):
        prompt = fresh_prompt(tokens, seed + i)  # the same prompt on both setups: their workers share no cache
        c = asyncio.run(first_two_tokens(colocated, prompt))
        d = asyncio.run(first_two_tokens(disaggregated, prompt))
        rows.append({"colocated": c, "disaggregated": d})
        print(f"  {tokens} tokens, pair {i + 1}/{reps}: colocated TTFT {c[0]:.2f} s (2nd token {c[1]:.2f} s), "
              f"disaggregated {d[0]:.2f} s ({d[1]:.2f} s)", flush=True)
    med = {key: statistics.median(r[mode][k] for r in rows)
           for key, mode, k in (("colocated_ttft_s", "colocated", 0), ("disagg_ttft_s", "disaggregated", 0),
                                ("colocated_second_s", "colocated", 1), ("disagg_second_s", "disaggregated", 1))}
    return {"tokens": tokens, **med, "added_ttft_pct": added_pct(rows, 0), "added_second_pct": added_pct(rows, 1),
            "pairs": rows}


def added_pct(pairs: list[dict], k: int) -> float:
    """The median over pairs of what disaggregation adds to time ``k`` (0: TTFT, 1: 2nd token), in %."""
    return statistics.median(100 * (p["disaggregated"][k] - p["colocated"][k]) / p["colocated"][k] for p in pairs)


def run(tree: Path, sizes: list[int], reps: int, seed: int) -> list[dict]:
    sys.path.insert(0, str(tree))
    os.chdir(tree)  # workers and routers are `python -m pdserve...` of that checkout
    os.environ["PYTHONPATH"] = str(tree)
    from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready
    from tests.integration.conftest import start_router

    common = ["--port", "0", "--model", MODEL, "--no-load-progress", "--num-threads", "1", "--kv-cache-memory-gb",
              "1", "--max-num-batched-tokens", str(BUDGET)]
    workers = [start_worker("decode", common), start_worker("prefill", common), start_worker("decode", common)]
    routers = []
    try:
        wait_ready(workers, timeout_s=300)
        for w, core in zip(workers, (0, 0, 1)):
            pin(w.pid, core)
        routers.append(start_router([workers[0].address], MODEL, "--max-concurrent-requests", "64"))
        routers.append(start_router([workers[1].address, workers[2].address], MODEL, "--max-concurrent-requests",
                                    "64"))
        (_, colocated), (_, disaggregated) = routers
        asyncio.run(first_two_tokens(colocated, fresh_prompt(600, seed - 1)))  # warm both paths up
        asyncio.run(first_two_tokens(disaggregated, fresh_prompt(600, seed - 2)))
        return [measure(colocated, disaggregated, tokens, reps, seed + 1000 * tokens) for tokens in sizes]
    finally:
        for proc, _ in routers:
            proc.terminate()
            proc.wait(30)
        stop_workers(workers, grace_s=10)


def families(out: Path) -> dict[str, dict[int, list[list[dict]]]]:
    """Every run in ``out`` by tag family (``before-r2`` is of ``before``): prompt length -> each
    run's pairs."""
    found: dict[str, dict[int, list[list[dict]]]] = {}
    for path in sorted(out.glob("pd_chunk_overlap_*.json")):
        run_ = json.loads(path.read_text())
        family = run_["tag"].split("-r")[0]
        for row in run_["rows"]:
            found.setdefault(family, {}).setdefault(row["tokens"], []).append(row["pairs"])
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "before", kv[0])))  # "before" first


def summary(out: Path) -> list[str]:
    """A table over every run found: medians over all pairs of a family's runs."""
    lines = ["runs | prompt tokens | pairs | added TTFT (median of pairs) | each run's median | added to 2nd token",
             "--- | --- | --- | --- | --- | ---"]
    for family, by_tokens in families(out).items():
        for tokens, runs in sorted(by_tokens.items()):
            pairs = [p for r in runs for p in r]
            each = ", ".join(f"{added_pct(r, 0):+.1f}%" for r in runs)
            lines.append(f"{family} | {tokens} | {len(pairs)} | {added_pct(pairs, 0):+.1f}% | {each} | "
                         f"{added_pct(pairs, 1):+.1f}%")
    return lines


def plot(out: Path) -> Path:
    """Bars: each family's median over all its pairs; dots: each run's median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = families(out)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    width = 0.8 / max(len(found), 1)
    for j, (family, by_tokens) in enumerate(found.items()):
        lengths = sorted(by_tokens)
        for ax, k in zip(axes, (0, 1)):
            xs = [x + j * width for x in range(len(lengths))]
            ax.bar(xs, [added_pct([p for r in by_tokens[t] for p in r], k) for t in lengths], width, label=family,
                   color=f"C{j}", alpha=0.7)
            for x, t in zip(xs, lengths):
                ax.plot([x] * len(by_tokens[t]), [added_pct(r, k) for r in by_tokens[t]], "k.", ms=4)
            ax.set_xticks([x + width * (len(found) - 1) / 2 for x in range(len(lengths))], [str(t) for t in lengths])
    axes[0].axhline(10, ls="--", c="k", lw=1)
    axes[0].set_title("added TTFT of disaggregation", fontsize=10)
    axes[1].set_title("added time to the 2nd token (KV landed)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("prompt tokens (512-token step budget)")
        ax.set_ylabel("% over colocated (median of pairs)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out / "pd_chunk_overlap.png"
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: stop what we started
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2048,8190", help="prompt lengths in tokens (default: 2048,8190)")
    p.add_argument("--reps", type=int, default=3, help="colocated/disaggregated pairs per length (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]),
                   help="the checkout whose workers and routers run (default: this script's)")
    p.add_argument("--tag", default="after", help="the run's name in the JSON file and the plot (default: after)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    args = p.parse_args()
    out = Path(args.result_dir).resolve()
    tree = Path(args.tree).resolve()
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    flags = describe_cpu()
    rows = run(tree, [int(x) for x in args.sizes.split(",")], args.reps, args.seed)
    print(f"\n{args.tag} ({tree}, commit {commit}); CPU: {flags}; median of {args.reps} pairs, one thread "
          f"per worker, --max-num-batched-tokens {BUDGET}")
    print("prompt tokens | colocated TTFT (s) | disaggregated TTFT (s) | added TTFT | colocated 2nd token (s) | "
          "disaggregated 2nd token (s) | added to 2nd token")
    print("--- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        print(f"{r['tokens']} | {r['colocated_ttft_s']:.2f} | {r['disagg_ttft_s']:.2f} | {r['added_ttft_pct']:+.1f}% "
              f"| {r['colocated_second_s']:.2f} | {r['disagg_second_s']:.2f} | {r['added_second_pct']:+.1f}%")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pd_chunk_overlap_{args.tag}.json"
    path.write_text(json.dumps({"tag": args.tag, "tree": str(tree), "commit": commit, "cpu_flags": flags,
                                "budget": BUDGET, "reps": args.reps, "rows": rows}, indent=1))
    print("\nevery run in " + str(out) + " (bars of the plot; dots: each run's median):")
    print("\n".join(summary(out)))
    print(f"\nwrote {path} and {plot(out)}")


if __name__ == "__main__":
    main()
