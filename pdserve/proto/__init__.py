"""gRPC services and messages of the workers; generated stubs under v1/ (see generate.py)."""
