"""Runs a scheduled step through the model: inputs from the schedule, KV cache, sampling.

``execute(SchedulerOutput) -> ModelOutput``. The KV cache is one tensor
``[num_layers, 2, num_blocks, num_kv_heads, block_size * head_dim]``; layer ``l`` reads and
writes ``cache[l, 0]`` (keys, each block transposed: ``[head_dim, block_size]``) and
``cache[l, 1]`` (values, ``[block_size, head_dim]``); see attention.py.

With layer groups (a sliding-window model, see kv_cache_manager.KVGroups) the first dimension
is the groups' layer slots: layer ``l`` uses ``cache[groups.layer_slot[l]]`` at the blocks of
its group's table, and each step's metadata is built once per group (``GroupedMetadata``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pdserve.engine.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    GroupedMetadata,
    PrefillChunk,
    get_backend,
)
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_graphs import CpuGraphRunner
from pdserve.engine.cuda_graphs import CudaGraphRunner
from pdserve.engine.kv_cache_manager import KVGroups, cdiv
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.sampler import Sampler, token_logprobs
from pdserve.engine.scheduler import ModelOutput, ScheduledRequest, SchedulerOutput
from pdserve.engine.spec_decode import rejection_sample

PROMPT_LOGPROBS_SLICE_BYTES = 32 << 20


class _RowView:
    """A request as the sampler sees it at one verification row: the proposals before the row
    count as its output so far."""

    __slots__ = ("sampling_params", "eos_token_ids", "generator", "all_token_ids", "output_token_ids")

    def __init__(self, request, proposals: list[int]):
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.generator = request.generator
        self.all_token_ids = request.all_token_ids + proposals if proposals else request.all_token_ids
        self.output_token_ids = request.output_token_ids + proposals if proposals else request.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def float_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype | None:
    """The element dtype of a cache of floats: the model's (``auto``), or bfloat16 under float32
    activations (the CPU kernels widen it as they read, attention.py); None for a quantized cache
    (bytes with scales, kv_quant.py)."""
    return {"auto": dtype, "bfloat16": torch.bfloat16}.get(kv_cache_dtype)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device="cpu",
                      num_slots: int | None = None) -> torch.Tensor:
    # Not zeroed: zeroing gigabytes costs seconds at start-up (every page faulted in), and no
    # reader trusts a slot it did not write (the torch decode path zeroes the values it masks).
    # Nor advised transparent huge pages (MADV_HUGEPAGE), tried and taken back: on a 2-core KVM
    # Xeon first-touching a 2 GiB cache took 3.2 s with them against 0.39 s in 4 KiB pages (the
    # kernel compacting memory for each 2 MiB), and a served 512-token prefill's KV writes, all to
    # blocks not written before, 51 ms against 8.
    shape = (num_slots or cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size * cfg.head_dim)
    return torch.empty(shape, dtype=dtype, device=device)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_groups: KVGroups | None = None,
        cpu_graph_max_batch: int = 0,
    ):
        cfg = model.config
        # Prompt logprobs: rows of logits per slice, about PROMPT_LOGPROBS_SLICE_BYTES (float32), a multiple of 16
        self._prompt_logprobs_rows = max(16, PROMPT_LOGPROBS_SLICE_BYTES // (4 * cfg.vocab_size) // 16 * 16)
        # One group unless given: every layer its own slot, one block table.
        self.groups = kv_groups or KVGroups.one(cfg.num_layers)
        self.model = model
        self.block_size = block_size
        self.dtype = model.norm.weight.dtype  # the activations' (quantized weights, bf16 too, differ from it)
        self.device = next(model.parameters()).device
        nb, kvh, hd = num_blocks, cfg.num_kv_heads, cfg.head_dim
        self.kv_cache_dtype = kv_cache_dtype
        slots = self.groups.layer_slot
        cache_dtype = float_cache_dtype(kv_cache_dtype, self.dtype)
        if cache_dtype is not None:
            self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, cache_dtype, self.device,
                                              self.groups.num_slots)
            self.layer_caches = [
                (self.kv_cache[i, 0].view(nb, kvh, hd, block_size), self.kv_cache[i, 1].view(nb, kvh, block_size, hd))
                for i in slots
            ]
        else:  # quantized: bytes, each block's scales inside it (see kv_quant.py)
            from pdserve.engine import kv_quant

            self.kv_cache = kv_quant.allocate_quantized_cache(self.groups.num_slots, nb, kvh, block_size, hd,
                                                              self.device)
            qdtype = kv_quant.KV_CACHE_DTYPES[kv_cache_dtype]
            self.layer_caches = [kv_quant.layer_views(self.kv_cache, i, qdtype, block_size, hd) for i in slots]
        # Called before each step with the step's items; returns what to call after each layer
        # (see LlamaForCausalLM.forward), or None when nothing is wanted from this step's layers.
        self.layer_hook: Callable[[list[ScheduledRequest]], Callable[[int], None] | None] | None = None
        if cache_dtype is None:
            from pdserve.engine.kv_quant import CpuQuantizedKVAttention, QuantizedKVAttention

            # on CPU (the cpu backend, auto there): read and written in place by the C kernels
            on_cpu = attention_backend == "cpu" or (attention_backend == "auto" and self.device.type == "cpu")
            if on_cpu:
                self.backend = CpuQuantizedKVAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
                self.backend.bf16_products = model.bf16_matmuls
            else:
                self.backend = QuantizedKVAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        else:
            self.backend = get_backend(attention_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       self.device.type)
            if isinstance(self.backend, CpuPagedAttention) and model.bf16_matmuls:
                self.backend.choose_prefill_products(block_size, torch.get_num_threads())
        # On CUDA, steps run through cuda_graphs: inputs moved to the GPU, decode steps replayed as graphs.
        self.cuda_graphs = CudaGraphRunner(model, self.layer_caches, self.backend, block_size) \
            if self.device.type == "cuda" else None
        # On a CPU, decode-only steps of up to cpu_graph_max_batch requests replay their kernels' calls (cpu_graphs)
        self.cpu_graphs = None
        # (not for sliding-window layers: their views of the metadata are made per step, as long as their windows)
        if self.device.type == "cpu" and cpu_graph_max_batch > 0 and self.groups.num_groups == 1 \
                and not cfg.sliding_window:
            from pdserve.engine.cpu_kernels import load_kernels

            self.cpu_graphs = CpuGraphRunner(model, self.layer_caches, self.backend, block_size,
                                             cpu_graph_max_batch, load_kernels())
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        out = ModelOutput()
        graphed = self._graphed(sched)
        if graphed is not None:  # a decode-only step replayed (cpu_graphs): every request samples its one row
            items, logits = graphed
            sampling = [(item, [i]) for i, item in enumerate(items)]
        else:
            items, hidden, sample_rows = self._forward(sched)
            sampling = [(item, rows) for item, rows in zip(items, sample_rows) if item.sample]
            for item, rows in zip(items, sample_rows):
                if item.request.prompt_logprobs is not None and not item.request.prompt_logprobs_sent:
                    self._prompt_logprobs(item, rows[-1] - item.num_tokens + 1, hidden, out)
            if not sampling:
                return out
            logits = self.model.compute_logits(hidden[[row for _, rows in sampling for row in rows]])
        if logits.device.type != "cpu":  # the sampler (per-request generators, penalties) runs on the CPU
            logits = logits.float().cpu()
        # One sampler row per logits row; a request verifying proposals has k + 1 of them, each
        # seeing the proposals before it as its output so far (penalties, min_tokens).
        views = [_RowView(item.request, item.spec_token_ids[:i]) if item.num_spec else item.request
                 for item, rows in sampling for i in range(len(rows))]
        any_spec = any(item.num_spec for item, _ in sampling)
        # A seeded request verifying k proposals draws k + 1 times; it is rewound afterwards to
        # where one draw per emitted token leaves it (see spec_decode: seeded sampling).
        rewind = {id(item): item.request.generator.get_state() for item, _ in sampling
                  if item.num_spec and item.request.generator is not None}
        tokens, logprobs = self.sampler(logits.clone() if any_spec else logits, views)  # it works in place
        r = 0
        for item, rows in sampling:
            request, n = item.request, len(rows)
            if not item.num_spec:
                out.sampled_token_ids[request.request_id] = [tokens[r]]
                if logprobs[r] is not None:
                    out.logprobs[request.request_id] = [logprobs[r]]
            else:
                emitted = self._verify(item, logits[r : r + n], views[r : r + n], tokens[r : r + n])
                out.sampled_token_ids[request.request_id] = emitted
                if id(item) in rewind:
                    request.generator.set_state(rewind[id(item)])
                    torch.empty(len(emitted), logits.shape[-1]).exponential_(generator=request.generator)
                if request.sampling_params.logprobs is not None:
                    out.logprobs[request.request_id] = [
                        lp if lp is not None and lp.sampled.token_id == t else
                        self.sampler.logprobs_of(logits[r + i], t, request.sampling_params.logprobs)
                        for i, (t, lp) in enumerate(zip(emitted, logprobs[r : r + n]))]
            r += n
        return out

    def _prompt_logprobs(self, item: ScheduledRequest, row: int, hidden: torch.Tensor, out: ModelOutput) -> None:
        """Logprobs of the prompt tokens this chunk predicts: row ``row + j`` (position
        ``start + j``) predicts prompt token ``start + j + 1``.

            prompt:   t0  t1  t2  t3  t4          chunk: positions 1..3
            rows:         r0  r1  r2              r0 -> t2, r1 -> t3, r2 -> t4
        """
        request = item.request
        prompt = request.prompt_token_ids
        count = min(item.num_tokens, len(prompt) - 1 - item.start)
        if count <= 0:
            return
        k = request.sampling_params.prompt_logprobs
        values = []
        # In slices of a fixed size: a chunk's logits at once (rows up to the token budget x the
        # vocabulary, 384 MiB for 2,048 rows of a 49,152-token vocabulary) made every new prompt
        # length a new, larger block that the heap kept (engine/cpu_kernels.py HeapBound).
        step = self._prompt_logprobs_rows
        for a in range(0, count, step):
            b = min(count, a + step)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[row + a : row + b]).float().cpu(), dim=-1)
            values += [token_logprobs(logprobs[j - a], prompt[item.start + j + 1], k) for j in range(a, b)]
        out.prompt_logprobs[request.request_id] = (item.start + 1, values)

    def _verify(self, item: ScheduledRequest, logits: torch.Tensor, views, tokens: list[int]) -> list[int]:
        """The accepted proposals and one token of the target's (see spec_decode)."""
        proposals = item.spec_token_ids
        if item.draft_probs is None or item.request.sampling_params.greedy:
            # One-hot proposals: the target's own token at each row, kept while it equals the proposal.
            emitted = []
            for i, token in enumerate(tokens):
                emitted.append(token)
                if i == len(proposals) or token != proposals[i]:
                    break
            return emitted
        probs = self.sampler.probabilities(logits, views)
        generator = item.request.generator or self.sampler.generator
        return rejection_sample(probs, proposals, item.draft_probs, generator)

    @torch.inference_mode()
    def logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits at each scheduled item's last row, in ``sched.scheduled`` order (no sampling)."""
        items, hidden, sample_rows = self._forward(sched)
        by_item = {id(item): rows[-1] for item, rows in zip(items, sample_rows)}
        return self.model.compute_logits(hidden[[by_item[id(item)] for item in sched.scheduled]]).float().cpu()

    def _graphed(self, sched: SchedulerOutput):
        """(items, logits) of a decode-only step the CPU graphs take (``cpu_graphs``): every request one
        token, sampled, no proposals, no prompt logprobs due, no layer hook; else None."""
        graphs, items = self.cpu_graphs, sched.scheduled
        if graphs is None or not graphs.enabled or not 0 < len(items) <= graphs.max_batch or graphs.refused(len(items)):
            return None
        for item in items:
            request = item.request
            if (item.num_tokens != 1 or not item.sample or item.num_spec
                    or (request.prompt_logprobs is not None and not request.prompt_logprobs_sent)):
                return None
        if self.layer_hook is not None:  # (a prefill worker's KV export: it plans per step, so not asked twice)
            return None
        input_ids, positions, meta, _ = self.prepare_inputs(items)
        if not graphs.takes(meta, len(items)):
            return None
        return items, graphs.logits(input_ids, positions, meta)

    def _forward(self, sched: SchedulerOutput):
        # One-token requests first: the attention backend batches them together.
        items = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1)
        input_ids, positions, meta, sample_rows = self.prepare_inputs(items)
        layer_done = None if self.layer_hook is None else self.layer_hook(items)
        if self.cuda_graphs is not None:
            hidden = self.cuda_graphs.forward(input_ids, positions, meta, layer_done)
        else:
            hidden = self.model(input_ids, positions, self.layer_caches, meta, self.backend, layer_done)
        return items, hidden, sample_rows

    def prepare_inputs(self, items: list[ScheduledRequest]):
        """Flattened token ids, positions, attention metadata, and each item's rows to sample
        from (its last row; the last ``num_spec + 1`` when it verifies proposals)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        last_rows: list[int] = []
        dec_blocks: list[int] = []
        dec_req: list[int] = []
        dec_req_items: list[int] = []  # the item (index into ``items``) of each flat block
        dec_block_index: list[int] = []
        dec_block_ctx: list[int] = []
        dec_starts: list[int] = [0]
        dec_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        num_decodes = 0
        for item in items:
            start, n, table = item.start, item.num_tokens, item.block_ids
            row = len(ids)
            known = item.request.all_token_ids
            ids.extend(known[start : start + n])
            if start + n > len(known):  # proposals after the known tokens
                ids.extend(item.spec_token_ids[max(0, start - len(known)) : start + n - len(known)])
            span = range(start, start + n)
            pos.extend(span)
            slot_blocks.extend(table[p // bs] for p in span)
            last_rows.append(list(range(row + n - 1 - item.num_spec, row + n)))
            if n == 1:
                ctx = start + 1
                nblocks = cdiv(ctx, bs)
                dec_blocks.extend(table[:nblocks])
                dec_req.extend([num_decodes] * nblocks)
                dec_req_items.extend([len(last_rows) - 1] * nblocks)
                dec_block_index.extend(range(nblocks))
                dec_block_ctx.extend([ctx] * nblocks)
                dec_starts.append(dec_starts[-1] + nblocks)
                dec_lens.append(ctx)
                num_decodes += 1
            else:
                used = torch.tensor(table[: cdiv(start + n, bs)], dtype=torch.long)
                prefills.append(PrefillChunk(row, n, start, used))
        positions = torch.tensor(pos, dtype=torch.long)
        index = torch.tensor(dec_block_index, dtype=torch.long)
        ctx = torch.tensor(dec_block_ctx, dtype=torch.long)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long),
            slot_offsets=positions % bs,
            num_decodes=num_decodes,
            decode_block_ids=torch.tensor(dec_blocks, dtype=torch.long),
            decode_block_req=torch.tensor(dec_req, dtype=torch.long),
            decode_block_mask=(index[:, None] * bs + torch.arange(bs)[None, :]) < ctx[:, None],
            decode_starts=torch.tensor(dec_starts, dtype=torch.long),
            decode_lens=torch.tensor(dec_lens, dtype=torch.long),
            prefills=prefills,
        )
        if self.groups.num_groups > 1:
            meta = self._grouped(items, meta, positions, dec_req_items, dec_block_index)
        return torch.tensor(ids, dtype=torch.long), positions, meta, last_rows

    def _grouped(self, items: list[ScheduledRequest], meta: AttentionMetadata, positions: torch.Tensor,
                 dec_items: list[int], dec_block_index: list[int]) -> GroupedMetadata:
        """The step's metadata per layer group: the same positions and masks, each group's block ids
        (``meta`` was built from the first group's tables)."""
        slot_rows = torch.tensor([i for i, item in enumerate(items) for _ in range(item.num_tokens)], dtype=torch.long)
        slot_index = positions // self.block_size
        dec_rows, dec_index = torch.tensor(dec_items, dtype=torch.long), torch.tensor(dec_block_index, dtype=torch.long)
        prefill_items = [i for i, item in enumerate(items) if item.num_tokens != 1]
        width = max(len(item.group_block_ids[0]) for item in items)
        # Every group's tables in one tensor, [groups, items, width], padded with 0 (the null block's id).
        tables = torch.tensor([[ids + [0] * (width - len(ids)) for ids in item.group_block_ids] for item in items],
                              dtype=torch.long).transpose(0, 1)
        metas = [meta]
        for table in tables[1:]:
            chunks = [dataclasses.replace(c, block_ids=table[i, : len(c.block_ids)])
                      for i, c in zip(prefill_items, meta.prefills)]
            metas.append(dataclasses.replace(
                meta, slot_blocks=table[slot_rows, slot_index], decode_block_ids=table[dec_rows, dec_index],
                prefills=chunks))
        return GroupedMetadata(metas, self.groups.layer_group)
