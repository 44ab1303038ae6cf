"""Decode steps on a CPU replayed from a recorded tape: the C kernels' calls without the Python around them.

On a CPU every op of a decode step goes to a C kernel (``csrc/``, through ctypes): 300 calls for the
default model at batch 1, which take ~6 ms on 2 AVX2 cores while the Python that makes them (modules,
argument checks, a new output tensor per call) takes as long again. As CUDA graphs do on a GPU
(``cuda_graphs.py``), a decode-only step of ``b`` requests (``b <= max_batch``) is recorded once, its
model forward and output head, and later steps of ``b`` requests replay the recording:

- every call into the kernels' library (``cpu_kernels.load_kernels()``) with its arguments as given:
  pointers into the weights, the KV cache and the tensors the step made, which the tape keeps alive;
- every torch function the forward calls (``torch.overrides.TorchFunctionMode``): a view or a new empty
  tensor needs nothing at replay; a function that computes (the embedding, the rotations' lookup, a copy
  made contiguous, the last residual add, oneDNN's projections past the C kernels' rows) runs again on the
  tape's tensors and its answer is copied into the tensor the recorded calls read. A function outside
  ``REPLAYED``, or one that hands a tensor's values to Python (``.item()``), refuses the recording: that
  batch size then always runs eagerly.

The step's inputs go into fixed buffers first (token ids, positions, the decode block tables and slot
mapping of ``AttentionMetadata``, each with room for ``max_batch`` requests of the model's longest
context), which the recording read. Python that decides by the step's values rather than its shapes
would not be replayed, so the first replay of every size is checked: the step is also run eagerly and
the two logits must be equal bit for bit, or that size runs eagerly from then on (logged). A kernel
that reports a failure (a scratch allocation) makes that step run eagerly.

Only models without sliding-window layers are recorded (their windowed metadata is made per step), and no
step with a layer hook (a prefill worker's KV export); ``EngineConfig.cpu_graph_max_batch`` 0 turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

from pdserve.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)
_RECORDING = threading.Lock()

# Torch functions whose answers the recording computes again at replay (the answer a new tensor, its shape fixed by
# the batch size, copied into the one the recorded calls read). A function whose answer is a view of its input, or
# a new empty tensor (ALLOCATING), needs nothing at replay; any other one refuses the recording.
REPLAYED = frozenset({"embedding", "index_select", "add", "__add__", "__getitem__", "contiguous", "clone", "reshape",
                      "to", "float", "mul", "__mul__", "zeros", "zeros_like",
                      "_linear_pointwise", "pad"})  # (oneDNN's projections past the C kernels' rows, padded)
ALLOCATING = frozenset({"empty", "empty_like"})
# functions that hand a tensor's values to Python (what Python then does is not recorded)
TO_PYTHON = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__iter__",
                       "equal", "allclose"})


class _Refused(Exception):
    """The forward did something a recording cannot repeat."""


@dataclasses.dataclass
class _Graph:
    tape: list  # ("c", function, args, checks) or ("op", func, args, kwargs, [(output index, tensor to fill)])
    logits: torch.Tensor  # [b, vocab], written by each replay
    keep: list  # every tensor the step made (the recorded pointers point into them)
    checked: bool = False  # its first replay compared with an eager step


class _Recorder(TorchFunctionMode):
    """Every torch function the recorded forward calls, onto the tape, in order with the kernels' calls.
    (A function mode, not a dispatch mode: the first dispatch mode of a process imports torch._dynamo, 2-3 s.)"""

    def __init__(self, tape: list, keep: list):
        super().__init__()
        self.tape, self.keep = tape, keep

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        outputs = _flat(out)
        if not outputs:
            if name in TO_PYTHON:
                raise _Refused(f"{name} hands a tensor's values to Python")
            return out
        self.keep.extend(outputs)
        if name in ALLOCATING:
            return out
        inputs = {_storage(t) for t in _tensors(args, kwargs)}
        fresh = [(i, t) for i, t in enumerate(outputs) if _storage(t) is None or _storage(t) not in inputs]
        in_place = name.endswith("_") and not name.endswith("__") or name.startswith("__i")
        if not fresh and not in_place:  # a view of an input: the replayed calls read the same memory
            return out
        if name not in REPLAYED:
            raise _Refused(f"torch function {name}")
        self.tape.append(("op", func, args, kwargs, fresh))
        return out


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one (oneDNN's packed weights: an output of
    such a tensor is taken for a new one, computed, never for a view)."""
    return None if t.is_mkldnn else t.untyped_storage().data_ptr()


def _flat(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def _tensors(args, kwargs):
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class _CallRecorder:
    """One kernel of the library, recording the calls the recording thread makes."""

    def __init__(self, fn, tape: list, thread: int):
        self.fn, self.tape, self.thread = fn, tape, thread
        self.checks = fn.restype is ctypes.c_int  # returns non-zero on failure

    def __call__(self, *args):
        if threading.get_ident() == self.thread:
            self.tape.append(("c", self.fn, args, self.checks))
        return self.fn(*args)


class CpuGraphRunner:
    """Decode-only steps of up to ``max_batch`` requests recorded once per batch size and replayed."""

    def __init__(self, model, layer_caches, backend, block_size: int, max_batch: int, lib):
        self.model, self.layer_caches, self.backend, self.lib = model, layer_caches, backend, lib
        self.max_batch = max_batch
        self.enabled = lib is not None and max_batch > 0
        self.graphs: dict[int, _Graph | None] = {}  # None: refused, that size runs eagerly
        b, blocks = max_batch, -(-model.rope.max_positions // block_size)
        self.ids = torch.zeros(b, dtype=torch.long)
        self.positions = torch.zeros(b, dtype=torch.long)
        self.meta = AttentionMetadata(
            slot_blocks=torch.zeros(b, dtype=torch.long), slot_offsets=torch.zeros(b, dtype=torch.long),
            num_decodes=0, decode_block_ids=torch.zeros(b * blocks, dtype=torch.long),
            decode_block_req=torch.zeros(b * blocks, dtype=torch.long),
            decode_block_mask=torch.zeros(b * blocks, block_size, dtype=torch.bool),
            decode_starts=torch.zeros(b + 1, dtype=torch.long), decode_lens=torch.zeros(b, dtype=torch.long),
            prefills=[])

    def refused(self, n: int) -> bool:
        """Whether steps of ``n`` requests run eagerly for good (not recorded, or a replay found wrong)."""
        return n in self.graphs and self.graphs[n] is None

    def takes(self, meta, n: int) -> bool:
        """Whether a step of ``n`` one-token requests with this metadata may be recorded or replayed."""
        return (self.enabled and 0 < n <= self.max_batch and type(meta) is AttentionMetadata
                and meta.num_decodes == n and not meta.prefills and not meta.window and not self.refused(n))

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's logits ``[n, vocab]`` (n one-token requests; ``takes`` said yes), valid until the next step."""
        n = input_ids.shape[0]
        static = self._fill(input_ids, positions, meta)
        if n not in self.graphs:
            return self._record(n, static)
        graph = self.graphs[n]
        if not self._replay(graph):
            return self._eager(input_ids, positions, meta)
        if not graph.checked:
            eager = self._eager(input_ids, positions, meta)
            if not torch.equal(eager, graph.logits):
                log.warning("CPU graph of %d requests: its replay differs from the eager step; that batch size runs "
                            "eagerly", n)
                self.graphs[n] = None
                return eager
            graph.checked = True
        return graph.logits

    def _fill(self, input_ids, positions, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's inputs into the fixed buffers; the metadata of views of them, as long as the step's."""
        n = input_ids.shape[0]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        fields = {}
        # (what the kernels read; decode_block_req and decode_block_mask are the torch path's, which is not recorded)
        for f in ("slot_blocks", "slot_offsets", "decode_block_ids", "decode_starts", "decode_lens"):
            src, dst = getattr(meta, f), getattr(self.meta, f)
            if src.shape[0] > dst.shape[0]:
                raise ValueError(f"CPU graph: {f} of {src.shape[0]} rows past its buffer of {dst.shape[0]}")
            view = dst[: src.shape[0]]
            view.copy_(src)
            fields[f] = view
        return dataclasses.replace(meta, **fields)

    def _eager(self, input_ids, positions, meta) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.layer_caches, meta, self.backend)
        return self.model.compute_logits(hidden)

    def _record(self, n: int, meta: AttentionMetadata) -> torch.Tensor:
        tape, keep = [], []
        lib, thread = self.lib, threading.get_ident()
        why = None
        with _RECORDING:  # one recording at a time in the process: the library's functions are swapped for it
            saved = {name: fn for name, fn in vars(lib).items() if isinstance(fn, ctypes._CFuncPtr)}
            for name, fn in saved.items():
                setattr(lib, name, _CallRecorder(fn, tape, thread))
            try:
                with _Recorder(tape, keep):
                    logits = self._eager(self.ids[:n], self.positions[:n], meta)
            except _Refused as e:
                why = str(e)
            finally:
                for name, fn in saved.items():
                    setattr(lib, name, fn)
        # a kernel looked up for the first time while recording went past the recorders
        unseen = [name for name, fn in vars(lib).items() if isinstance(fn, ctypes._CFuncPtr) and name not in saved]
        if why is None and unseen:
            why = f"kernels {unseen} not recorded"
        if why is not None:
            return self._refuse(n, why, meta)
        self.graphs[n] = _Graph(tape, logits, keep)
        return logits

    def _refuse(self, n: int, why: str, meta: AttentionMetadata) -> torch.Tensor:
        """That batch size runs eagerly from now on (this step too: whatever the recording wrote, it writes again)."""
        log.info("CPU graph of %d requests not recorded (%s): that batch size runs eagerly", n, why)
        self.graphs[n] = None
        return self._eager(self.ids[:n], self.positions[:n], meta)

    @staticmethod
    def _replay(graph: _Graph) -> bool:
        """Every recorded call again; False where a kernel reported a failure (nothing else is done then)."""
        for entry in graph.tape:
            if entry[0] == "c":
                if entry[1](*entry[2]) and entry[3]:
                    return False
            else:
                _, func, args, kwargs, fresh = entry
                got = _flat(func(*args, **kwargs))
                for i, dst in fresh:
                    if got[i].shape != dst.shape:  # (a size the batch size did not fix: never seen so far)
                        return False
                    dst.copy_(got[i])
        return True
