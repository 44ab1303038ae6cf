"""The router's Prometheus metrics (one registry per router; served at /metrics).

Latency definitions, the same ones ``pdserve bench`` measures from outside:
- time to first token (TTFT): request received -> first token sent to the client;
- inter-token latency (ITL): gap between consecutive token-bearing messages of one choice;
- time per output token (TPOT): (end-to-end - TTFT) / (output tokens - 1), for outputs of
  two tokens or more;
- end-to-end latency: request received -> last byte of the response.
The workers measure the same, with the same buckets (pdserve/buckets.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.buckets import LATENCY_BUCKETS, TOKEN_BUCKETS

# Routing decisions take microseconds: 1 us to 100 ms
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("pdserve_router_errors", "Errors, by type", ["type"], registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Requests being served", registry=r)
        # by model: the name the request was served under (the stage that answered, for a cascade)
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds", "Request received to first token sent",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_inter_token_latency_seconds",
                             "Gap between consecutive token-bearing messages of a choice", ["model"],
                             buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_router_time_per_output_token_seconds",
                              "(end-to-end - TTFT) / (output tokens - 1), per choice of 2+ tokens", ["model"],
                              buckets=TOKEN_BUCKETS, registry=r)
        self.class_ttft = Histogram("pdserve_router_class_time_to_first_token_seconds", "TTFT by service class "
                                    "(service_tier served: priority, default, flex)", ["tier"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.class_tpot = Histogram("pdserve_router_class_time_per_output_token_seconds", "TPOT by service class",
                                    ["tier"], buckets=TOKEN_BUCKETS, registry=r)
        self.slo_requests = Counter("pdserve_router_slo_requests", "Requests of a class with an SLO (router.slo), "
                                    "by whether they met it (met: yes / no; a failed request did not); attainment "
                                    "= yes / (yes + no)", ["tier", "met"], registry=r)
        self.e2e = Histogram("pdserve_router_e2e_request_latency_seconds", "Request received to last byte sent",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of answered requests",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens", "Tokens generated and sent",
                                         ["model"], registry=r)
        self.retries = Counter("pdserve_router_retries", "Requests moved to another worker before streaming",
                               registry=r)
        self.prefill_decisions = Counter("pdserve_router_prefill_decisions", "Where prompts were prefilled: "
                                         "remote, or local_short / local_cached / local_faster / "
                                         "local_no_prefill_worker / local_no_room / local_prompt_logprobs",
                                         ["outcome"], registry=r)
        self.cascade_stages = Counter("pdserve_router_cascade_stages", "Cascade stages run, by model and outcome: "
                                      "accepted (its answer was sent), escalated (the next stage ran) or "
                                      "unavailable (no worker: the next stage ran)",
                                      ["model", "outcome"], registry=r)
        self.cached_tokens = Counter("pdserve_router_cached_tokens", "Prompt tokens found in the prefix cache "
                                     "where each request was prefilled: predicted by the prefix index when routed, "
                                     "and actual (what that worker reported reusing)", ["source"], registry=r)
        self.decision_seconds = Histogram("pdserve_router_routing_decision_seconds", "Time of a routing step: "
                                          "prompt_keys (hashing the prompt), lookup (the prefix index), decode / "
                                          "prefill (a policy choosing among that pool)", ["step"],
                                          buckets=DECISION_BUCKETS, registry=r)
        self.faults = Counter("pdserve_router_faults", "Worker faults handled, by reason (prefill_worker_failed, "
                              "prefill_refused, no_prefill_worker, decode_worker_lost, queue_timeout: a worker "
                              "ended a request unstarted at its queue timeout)", ["reason"], registry=r)
        self.migrations = Counter("pdserve_router_migrations", "Requests continued on another decode worker after "
                                  "tokens had streamed", registry=r)
        self.cold_starts = Counter("pdserve_router_cold_starts", "Requests that found a pool at zero workers and "
                                   "woke it (autoscaling min_replicas 0)", ["pool"], registry=r)
        self.prefix_index_blocks = Gauge("pdserve_router_prefix_index_blocks", "Distinct block hashes in the "
                                         "global prefix index (held by a worker in rotation)", registry=r)
        self.prefix_index_events = Counter("pdserve_router_prefix_index_events", "Workers' KV events read, by "
                                           "outcome: applied, ignored (duplicate, stale, or a worker not in "
                                           "rotation), buffered (its worker resyncing), resync (a gap or a restart)",
                                           ["outcome"], registry=r)
        self.prefix_index_resyncs = Counter("pdserve_router_prefix_index_resyncs", "Workers' entries rebuilt from "
                                            "their block lists, by reason (joined, gap, store) and result (ok, "
                                            "failed)", ["reason", "result"], registry=r)
        self.shared_routes = Counter("pdserve_router_shared_routes", "Routes shared with the other routers through "
                                     "the state store (router.share_routes), by direction: sent, received",
                                     ["direction"], registry=r)
        self.workers_healthy = Gauge("pdserve_router_workers_healthy", "Workers in rotation", registry=r)
        self.worker_running = Gauge("pdserve_worker_num_running", "Running requests (worker snapshot; workers "
                                    "in rotation)", ["worker"], registry=r)
        self.worker_waiting = Gauge("pdserve_worker_num_waiting", "Waiting requests (worker snapshot; workers "
                                    "in rotation)", ["worker"], registry=r)
        self.worker_kv_usage = Gauge("pdserve_worker_kv_cache_usage", "KV-cache blocks in use, fraction (worker "
                                     "snapshot; workers in rotation)", ["worker"], registry=r)
        self.worker_tps = Gauge("pdserve_worker_generation_tokens_per_second", "Recent generation rate (worker "
                                "snapshot; workers in rotation)", ["worker"], registry=r)
