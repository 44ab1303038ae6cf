"""A worker's Prometheus metrics (served on ``--metrics-port`` when given), both roles'.

The latency histograms have the router's definitions (router/metrics.py) and buckets
(pdserve/buckets.py), measured from the moment the worker receives a request: the difference
between the router's and the worker's is what routing and the network add. The KV-transfer
metrics of both sides are here too: a decode worker counts what it receives, a prefill worker
what it sends.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.buckets import LATENCY_BUCKETS, TOKEN_BUCKETS
from pdserve.engine.block_pool import KVEventBuffer


class RecentQuantile:
    """A quantile over the last ``window_s`` seconds of observations (what the autoscaler reads)."""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def observe(self, value: float) -> None:
        self._samples.append((self.clock(), value))

    def quantile(self, q: float) -> float | None:
        """None when nothing was observed within the window."""
        horizon = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, int(q * len(values)))]


class KVEventsDropped(Collector):
    """The engine's count of KV events dropped unread, read when scraped (the engine thread counts)."""

    def __init__(self, events: KVEventBuffer | None):
        self.events = events

    def collect(self):
        yield CounterMetricFamily("pdserve_worker_kv_events_dropped", "KV events dropped because nobody drained "
                                  "them in time (no state store, or it fell behind)",
                                  value=0 if self.events is None else self.events.dropped)


class WorkerMetrics:
    def __init__(self, kv_events: KVEventBuffer | None = None) -> None:
        """``kv_events``: the engine's event buffer, whose drop count is exported (None: none to count)."""
        # TTFT and TPOT over the last 30 s, in seconds (the autoscaler's SLO signals)
        self.recent_ttft = RecentQuantile()
        self.recent_tpot = RecentQuantile()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_worker_requests", "Requests finished, by finish reason", ["reason"],
                                registry=r)
        self.ttft = Histogram("pdserve_worker_time_to_first_token_seconds", "Request received to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_worker_inter_token_latency_seconds", "Gap between consecutive token "
                             "messages of a request", buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_worker_time_per_output_token_seconds", "(end-to-end - TTFT) / (output "
                              "tokens - 1), for 2+ tokens", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_worker_e2e_request_latency_seconds", "Request received to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_worker_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_worker_generation_tokens", "Tokens generated", registry=r)
        # Speculative decoding, per finished request that verified proposals
        self.spec_proposed = Counter("pdserve_worker_spec_proposed_tokens", "Speculative tokens proposed",
                                     registry=r)
        self.spec_accepted = Counter("pdserve_worker_spec_accepted_tokens", "Speculative tokens accepted",
                                     registry=r)
        self.spec_acceptance = Histogram("pdserve_worker_spec_acceptance_rate", "Per request: proposals accepted "
                                         "/ proposed", buckets=[i / 10 for i in range(11)], registry=r)
        self.spec_accepted_length = Histogram("pdserve_worker_spec_mean_accepted_length", "Per request: tokens "
                                              "emitted per verification step (accepted proposals + 1)",
                                              buckets=[1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10], registry=r)
        # KV transfers, decode side (receiving)
        self.kv_transfers = Counter("pdserve_kv_transfers", "Reserved requests resumed, by outcome (ok: the KV "
                                    "landed; recomputed: the prompt was computed here)", ["outcome"], registry=r)
        self.kv_failures = Counter("pdserve_kv_transfer_failures", "Transfers that failed, by reason", ["reason"],
                                   registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_received_bytes", "KV bytes received", registry=r)
        self.kv_transfer_time = Histogram("pdserve_kv_transfer_seconds", "First chunk to commit, per transfer",
                                          buckets=LATENCY_BUCKETS, registry=r)
        # KV transfers, prefill side (sending)
        self.kv_sent = Counter("pdserve_kv_transfer_sent", "Transfers sent, by outcome", ["outcome"], registry=r)
        self.kv_sent_bytes = Counter("pdserve_kv_transfer_sent_bytes", "KV bytes sent", registry=r)
        r.register(KVEventsDropped(kv_events))
