"""KV transfer between workers: the protocol (base.py), the receiving side, backends by name."""
