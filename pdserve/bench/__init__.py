"""The load generator (pdserve bench), workloads, latency metrics and plots; benchmark stand-ins."""
