"""Model loading: names, Hugging Face folders, GGUF tokenizer, bad specs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pdserve.configs import ConfigError
from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.loader import load_model, ours_to_hf
from pdserve.engine.sources import resolve_model


def test_default_name_resolves_to_the_packaged_gguf():
    source = resolve_model("smollm2-135m-instruct")
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.exists()


@pytest.mark.parametrize("spec", ["no-such-model", "random:no-such-preset", "/nonexistent/model.gguf"])
def test_unknown_model_names_the_field(spec):
    with pytest.raises(ConfigError, match="^model: "):
        resolve_model(spec)
    with pytest.raises(ConfigError, match="model"):
        LLM(model=spec)


def test_unknown_engine_option_is_refused():
    with pytest.raises(ConfigError, match="max_num_seq"):
        LLM(model="random:tiny", max_num_seq=3)


def write_hf_folder(path, loaded) -> None:
    cfg = loaded.config
    hf_cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "max_position_embeddings": 2048, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings, "eos_token_id": 2,
        "bos_token_id": 1, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(hf_cfg))
    state = {k: v.contiguous().clone() for k, v in ours_to_hf(loaded.model.state_dict(), cfg).items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(path / "model.safetensors"))
    loaded.tokenizer.tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": loaded.tokenizer.info.chat_template,
    }))


def test_hf_folder_loads_and_matches_the_same_weights(tmp_path, tiny_model):
    write_hf_folder(tmp_path, tiny_model)
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.source.kind == "hf" and loaded.config.num_layers == tiny_model.config.num_layers
    assert loaded.tokenizer.eos_token_ids == (2,)
    assert loaded.tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == \
        tiny_model.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    prompt = tiny_model.tokenizer.encode("Paged attention keeps the KV cache in blocks")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for lm in (loaded, tiny_model):
        engine = LLMEngine(EngineConfig(model=lm.source.name, num_kv_blocks=64, load_progress=False), loaded=lm)
        engine.add_request("x", prompt, params)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        outs.append(tokens)
    assert outs[0] == outs[1]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.inference_mode():
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert outs[0] == hf_tokens


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(tiny_model):
    transformers = pytest.importorskip("transformers")
    source = resolve_model("smollm2-135m-instruct")
    hf = transformers.AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    texts = [
        "Hello world", "  leading spaces and\ttabs\n\nnewlines", "naïve café Grüße 🙂 東京",
        "def f(x):\n    return x ** 2  # square", "It's 3:45pm on 2024-11-30; I'll pay $1,234.56.",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ]
    ours = tiny_model.tokenizer
    for text in texts:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
