"""Reading a GGUF file's metadata and tensor table quickly; ``gguf`` dequantises the blocks.

``gguf.GGUFReader`` builds a numpy view per array element, which costs 2-4 s for a 49k-token
vocabulary and its merges: more than the rest of loading SmolLM2 together. This reader walks
the same layout with ``struct`` (about 0.2 s) and hands each tensor's bytes to
``gguf.quants.dequantize``.

Layout (little-endian): magic ``GGUF``, version (u32), tensor count (u64), metadata count (u64),
metadata key/value pairs, tensor infos (name, dims fastest-first, ggml type, offset), padding
to ``general.alignment``, tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

# metadata value types: fixed-size scalars; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        # copy-on-write: views torch can take as writable (none is written; the file is untouched)
        self._blob = np.memmap(self.path, mode="c", dtype=np.uint8)
        size = 16 << 20
        while True:  # the metadata's size is not known up front: read a prefix, grow it if short
            try:
                self._parse(bytes(self._blob[:size]))
                return
            except struct.error:
                if size >= len(self._blob):
                    raise ValueError(f"{self.path}: truncated GGUF metadata") from None
                size *= 4

    def _parse(self, buf: bytes) -> None:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path} is GGUF version {version}; versions 2 and 3 are supported")
        self._buf, pos = buf, 24
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key, pos = self._string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            self.fields[key], pos = self._value(pos + 4, kind)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, ggml_type, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            count = int(np.prod(shape))
            self.tensors[name] = GGUFTensor(name, shape, ggml_type, data_start + offset, count // block * block_bytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        if pos + 8 + n > len(self._buf):
            raise struct.error("past the end of the buffer")
        return self._buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n

    def _value(self, pos: int, kind: int):
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if kind == _STRING:
            return self._string(pos)
        if kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            if item_kind in _SCALARS:
                fmt = f"<{count}{_SCALARS[item_kind]}"
                return list(struct.unpack_from(fmt, self._buf, pos)), pos + struct.calcsize(fmt)
            if item_kind == _STRING:  # vocabularies and merges: the hot loop of reading a GGUF
                return self._strings(pos, count)
            items = []
            for _ in range(count):
                item, pos = self._value(pos, item_kind)
                items.append(item)
            return items, pos
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind}")

    def _strings(self, pos: int, count: int) -> tuple[list[str], int]:
        buf, length = self._buf, struct.Struct("<Q").unpack_from
        items = []
        for _ in range(count):
            (n,) = length(buf, pos)
            items.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        if pos > len(buf):
            raise struct.error("past the end of the buffer")
        return items, pos

    def dequantize(self, name: str) -> np.ndarray:
        """A tensor as float32, in torch order."""
        t = self.tensors[name]
        raw = np.asarray(self._blob[t.offset : t.offset + t.nbytes])  # a plain view: memmap slices are slow
        ggml_type = GGMLQuantizationType(t.ggml_type)
        if ggml_type == GGMLQuantizationType.F32:
            return np.array(raw.view(np.float32).reshape(t.shape))
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        rows = raw.reshape(*t.shape[:-1], t.shape[-1] // block * block_bytes)
        import torch  # (here: the router reads GGUF tokenizers and never loads torch)

        from pdserve.engine.quant.gguf_native import TORCH_TYPES, dequantize_blocks

        if ggml_type in TORCH_TYPES:  # torch ops, bit for bit gguf.quants' float32 (4-6x faster: load time)
            flat = torch.from_numpy(rows.reshape(-1, rows.shape[-1]))
            return dequantize_blocks(ggml_type, flat, t.shape[-1]).numpy().reshape(t.shape)
        return dequantize(rows, ggml_type).astype(np.float32, copy=False).reshape(t.shape)
