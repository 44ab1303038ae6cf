"""Memory and time of oneDNN's packed linear (the engine's float32 path on AVX2/AVX-512) as the row
count varies, as it does from step to step in a serving engine: unpadded, and padded up to buckets.

    python benchmarks/onednn_shapes.py              # SmolLM2's MLP up-projection, row counts 5-604, twice
    python benchmarks/onednn_shapes.py --threads 2

Each configuration runs in a fresh process (oneDNN's primitive cache is per process): the engine's
own projection (``model.Linear`` on its oneDNN path, ``--out`` x ``--in``, with ``ROW_BUCKET`` set to
the configuration's bucket; 1 is unpadded) is called with
every row count from 5 to 604, then with all of them again. Printed: the process's resident memory
growth after 200, 400 and 600 counts of each pass (from its size after the first 16 counts), the wall
time of both passes, and whether every padded call's rows equal the unpadded call's bitwise. Then the
CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys, time, torch
from pdserve.engine.model import Linear
bucket, n, k, threads = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
torch.manual_seed(0)
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
Linear.ROW_BUCKET = bucket  # 1: unpadded
Linear.BUCKETS_PER_DOUBLING = 0  # every bucket the configuration's width (the engine widens them from 512 rows)
linear = Linear(k, n)
torch.nn.init.normal_(linear.weight)
linear.prepare_for_cpu(1, None, "onednn")  # no C kernels: every row count takes the oneDNN path
packed = linear.packed_weight()
growth, exact, base = [], True, None
started = time.perf_counter()
for rep in range(2):
    for m in range(5, 605):
        x = torch.randn(m, k)
        y = linear(x)
        if bucket > 1 and m % 50 == 0:
            exact &= torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        if rep == 0 and m == 20:
            base = rss_mib()
        if m % 200 == 4:
            growth.append(rss_mib() - base)
print(json.dumps({"growth": growth, "seconds": time.perf_counter() - started, "exact": exact}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", default="1,16,64", help="row buckets to compare; 1 is unpadded (default: 1,16,64)")
    p.add_argument("--out", type=int, default=1536, help="output features (default: 1536, SmolLM2's MLP)")
    p.add_argument("--in", dest="inp", type=int, default=576, help="input features (default: 576)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from pdserve.engine.cpu_isa import describe_cpu

    print(f"oneDNN packed linear {args.out} x {args.inp}, {args.threads} thread(s); RSS growth in MiB after "
          "200/400/600 row counts, first pass | second pass")
    print("| bucket | first pass | second pass | both passes (s) | rows bitwise equal to unpadded |")
    print("|---|---|---|---:|---|")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for bucket in (int(b) for b in args.buckets.split(",")):
        done = subprocess.run([sys.executable, "-c", CHILD, str(bucket), str(args.out), str(args.inp),
                               str(args.threads)], capture_output=True, text=True, check=True, env=env)
        r = json.loads(done.stdout.splitlines()[-1])
        g = [f"{x:+.0f}" for x in r["growth"]]
        same = "-" if bucket == 1 else ("yes" if r["exact"] else "**no**")
        print(f"| {bucket} | {' / '.join(g[:3])} | {' / '.join(g[3:])} | {r['seconds']:.1f} | {same} |", flush=True)
    print(describe_cpu())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
