"""Histogram buckets shared by the router's and the workers' latency metrics.

The router (router/metrics.py) and each worker (worker/metrics.py) measure TTFT, ITL, TPOT and
end-to-end latency with the same definitions; the same buckets make their histograms directly
comparable (the difference is what routing and the network add). Here, below both, so neither
imports the other for them.
"""

from __future__ import annotations

# request-scale latencies: TTFT, end-to-end, a KV transfer (seconds)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# token-scale latencies: ITL, TPOT (seconds)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                 2.5, 5.0)
