"""What both worker roles share: the servicer base, the gRPC server around an engine, the
worker's config, metrics, wire conversions and registration. The roles (decode_worker,
prefill_worker) build on it and never import each other; servicer.py draws a request's lifecycle."""
