"""Our Llama against transformers' LlamaForCausalLM on the same random weights (float32).

Logits must agree within 1e-4 relative (max abs difference over max abs logit) for the
prefill and for 20 decode steps through the paged cache, with two requests of different
lengths in one batch and the second prefilled in chunks.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import ModelConfig, RopeScaling
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.loader import build_model, ours_to_hf
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ModelOutput, Scheduler

transformers = pytest.importorskip("transformers")

SHAPES = {
    "gqa-tied": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                            num_kv_heads=2, rope_theta=10000.0),
    "mha-untied": ModelConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=3,
                              num_kv_heads=3, tie_word_embeddings=False),
    "gqa8-llama3-rope": ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=2,
                                    num_heads=8, num_kv_heads=1, head_dim=32, rope_theta=500000.0,
                                    rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32),
                                    tie_word_embeddings=False),
}


def hf_model(cfg: ModelConfig, ours: torch.nn.Module):
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings, "rope_theta": cfg.rope_theta}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=cfg.tie_word_embeddings,
    )
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = model.load_state_dict(ours_to_hf(ours.state_dict(), cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(shape, backend):
    cfg = SHAPES[shape]
    ours = build_model(cfg, None, seed=1)
    ref = hf_model(cfg, ours)
    runner = ModelRunner(ours, num_blocks=32, block_size=4, attention_backend=backend)
    scheduler = Scheduler(KVCacheManager(32, 4), max_num_batched_tokens=9, max_num_seqs=4)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 13)]
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))
                for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add_request(r)

    worst = 0.0
    with torch.inference_mode():
        while scheduler.has_unfinished():
            sched = scheduler.schedule()
            items = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1)
            ids, positions, meta, _ = runner.prepare_inputs(items)
            logits = ours.compute_logits(ours(ids, positions, runner.layer_caches, meta, runner.backend))
            out, row = ModelOutput(), 0
            for item in items:
                tokens = item.request.all_token_ids[: item.start + item.num_tokens]
                expected = ref(torch.tensor([tokens])).logits[0, item.start :]
                got = logits[row : row + item.num_tokens]
                worst = max(worst, rel_err(got, expected))
                assert rel_err(got, expected) < 1e-4, (shape, item.request.request_id, item.start)
                if item.sample:
                    out.sampled_token_ids[item.request.request_id] = [int(got[-1].argmax())]
                row += item.num_tokens
            scheduler.update(sched, out)
    assert all(r.num_output_tokens == 21 for r in requests)
    print(f"{shape}, {backend} attention: worst relative logit error {worst:.2e}")
