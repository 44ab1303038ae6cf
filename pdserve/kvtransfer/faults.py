"""Fault injection for transfer tests, through the real sending path: NOT for production use.

A prefill worker started with ``--kv-fault drop:3`` leaves out layer 3's chunk, ``corrupt:3``
flips a byte of it after its checksum was computed, ``stall:5`` waits 5 s before committing
(past a short lease). The decode side must notice each and compute the prompt itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVFaults:
    drop_layer: int | None = None
    corrupt_layer: int | None = None
    stall_s: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> KVFaults:
        if not spec:
            return cls()
        kind, _, value = spec.partition(":")
        try:
            if kind == "drop":
                return cls(drop_layer=int(value))
            if kind == "corrupt":
                return cls(corrupt_layer=int(value))
            if kind == "stall":
                return cls(stall_s=float(value))
        except ValueError:
            pass
        raise ValueError(f"--kv-fault: expected drop:LAYER, corrupt:LAYER or stall:SECONDS, got {spec!r}")
