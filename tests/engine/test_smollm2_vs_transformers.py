"""SmolLM2-135M-Instruct through our engine against transformers loading the same GGUF.

transformers reads the GGUF itself (about a minute here), so this also checks our GGUF
reader: dequantisation and the q/k row order llama.cpp uses for RoPE.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.loader import ours_to_hf
from pdserve.engine.sources import resolve_model
from tests.conftest import run_to_completion

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

CHATS = [
    "What is the capital of France?",
    "Write a short poem about autumn.",
    "How many legs does a spider have?",
    "Explain what a hash table is.",
    "Give three tips for better sleep.",
    "What is the largest planet in the solar system?",
    "Summarise the plot of Cinderella in two sentences.",
    "Why do we have seasons?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    source = resolve_model("smollm2-135m-instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
    )
    return model.eval()


def test_weights_match_transformers_gguf_loader(default_model, hf_model):
    ours = ours_to_hf(default_model.model.state_dict(), default_model.config)
    theirs = hf_model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_tokens_match_transformers_generate(default_model, hf_model):
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, load_progress=False), loaded=default_model)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHATS]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = run_to_completion(engine)
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            # An explicit mask: the chat template holds <|im_end|>, which is also the pad token,
            # and generate would otherwise mask it out of the prompt.
            ids = torch.tensor([p])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=2)
            expected = out[0, len(p):].tolist()
            if ours[str(i)] != expected:
                k = next(j for j, (a, b) in enumerate(zip(ours[str(i)], expected)) if a != b)
                logits = hf_model(torch.tensor([p + expected[:k]])).logits[0, -1]
                top = logits.topk(2).values
                margin = float(top[0] - top[1])
                assert margin < 1e-3, f"prompt {i}: differs at token {k}, top-2 margin {margin:.4f}"
                print(f"prompt {i}: near-tie at token {k}, top-2 margin {margin:.2e}")
