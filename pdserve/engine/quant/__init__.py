"""Quantization (weight-only, and ``w8a8_int8``'s activations), chosen by ``EngineConfig.quantization``
(vLLM's ``--quantization``).

``quantize_model`` swaps each decoder layer's projections (qkv, o, gate_up, down) for a
quantized drop-in of ``model.Linear`` after the float model is loaded. The embedding stays float.
The output head is read whole at every decode step (in the default model 108 MiB of float32
against 62 MiB of int4 layers), so it is quantized too: under ``bf16`` to one bfloat16 table
shared with the embedding; on CPU (Llama models), under ``gguf`` it multiplies from the file's own
Q8_0/Q4 table and under ``int8``, ``int4`` and ``awq`` from Q8_0 blocks made at load (30 MiB),
the tied embedding looking up the same weights dequantised (``gguf_native.use_block_head``).

On CPUs with AVX2 or AVX-512 VNNI, int8, int4, awq, gguf and those heads multiply in byte dot
products (``csrc/cpu_qdot.c``, weights in ``qdot``'s tiles: 4.6 / 8.5 bits a weight), x split in
two int8 parts per 32 inputs (~15 bits), below 256 rows; the heads at every row count.

| method | what | module |
|---|---|---|
| ``int8`` | per-output-channel symmetric int8 | ``formats.Int8Linear`` |
| ``w8a8_int8`` | ``int8``'s weights; prefill chunks' activations int8 per token (VNNI, AVX2) | ``formats.W8A8Linear`` |
| ``int4`` | 4-bit, one scale and zero per ``quantization_group_size`` inputs | ``formats.Int4Linear`` |
| ``awq`` | int4 after AWQ's activation-aware input scaling, calibrated at load | ``awq`` + ``Int4Linear`` |
| ``fp8`` | float8 e4m3 weights and activations (CUDA GPUs with FP8 only) | ``formats.Fp8Linear`` |
| ``gguf`` | a GGUF file's own blocks, bit for bit; long prefill chunks dequantise | ``gguf_native.GGUFLinear`` |
| ``bf16`` | bfloat16 weights (output head and embedding too), float32 activations | ``formats.BF16Linear`` |
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.configs import ConfigError
from pdserve.engine.quant.formats import (
    BF16Linear,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    W8A8Linear,
    fp8_supported,
    int4_group_size,
    int8_matmuls,
    weight_levels,
)

log = logging.getLogger(__name__)

METHODS = ("none", "int8", "w8a8_int8", "int4", "awq", "fp8", "gguf", "bf16")
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

__all__ = ["METHODS", "QuantLinear", "check_quantization", "quantize_model", "weight_bytes"]


def check_quantization(method: str, source_kind: str, device: torch.device | str) -> None:
    """Refuse, before loading, what this model and device cannot do."""
    device = torch.device(device)
    if method not in METHODS:
        raise ConfigError(f"EngineConfig.quantization: {method!r} is not one of {list(METHODS)}")
    if method == "fp8" and not fp8_supported(device):
        raise ConfigError(
            "EngineConfig.quantization: fp8 needs a CUDA GPU with FP8 support (compute capability 8.9+: "
            f"Ada, Hopper or newer); this engine runs on {device.type}. On CPUs use int8, int4 or awq"
        )
    if method == "gguf" and source_kind != "gguf":
        raise ConfigError(
            f"EngineConfig.quantization: gguf keeps a GGUF file's quantized blocks, but this model is a "
            f"{source_kind!r} model, not a .gguf file; use int8, int4 or awq to quantize it at load"
        )


def quantize_model(model, method: str, group_size: int = 32, gguf_path: Path | None = None,
                   tokenizer=None, calibration_ids: torch.Tensor | None = None) -> None:
    """Replace the decoder layers' float projections in place (see the module docstring).

    AWQ and w8a8_int8's SmoothQuant calibrate on ``calibration_ids``, or on ``awq.CALIBRATION_TEXT``
    through ``tokenizer``.
    """
    if method == "none":
        return
    if method == "awq" and model.config.architecture != "llama":
        # AWQ folds its scales into Llama's norm layout; Gemma 3's (four norms, (1 + w)) differs.
        raise ConfigError(f"EngineConfig.quantization: awq supports Llama models only, and this is a "
                          f"{model.config.architecture} model; use int8, int4, gguf or bf16")
    if method == "bf16":
        for i in range(len(model.layers)):
            for suffix in LAYER_LINEARS:
                name = f"layers.{i}.{suffix}"
                _swap(model, name, BF16Linear(model.get_submodule(name).weight))
        head = BF16Linear(model.lm_head.weight)  # decode streams it every token
        _swap(model, "lm_head", head)
        if model.config.tie_word_embeddings:  # one bf16 table for both, as the float model shares one
            model.embed_tokens.weight = torch.nn.Parameter(head.qweight, requires_grad=False)
        model.bf16_matmuls = True
        return
    if method == "gguf":
        from pdserve.engine.quant.gguf_native import gguf_linears, use_block_head

        linears = gguf_linears(gguf_path, model.config, _block_head(model))
        if "lm_head" in linears:
            use_block_head(model, linears.pop("lm_head"))
        device = model.embed_tokens.weight.device
        for name, linear in linears.items():
            _swap(model, name, linear.to(device))
        return

    def group_of(in_features: int) -> int:
        g = int4_group_size(in_features, group_size)
        if g is None:
            raise ConfigError(f"EngineConfig.quantization_group_size: no group size of {list((32, 64, 128))} "
                              f"divides this model's input size {in_features}")
        if g != group_size:
            log.info("int4: input size %d uses group size %d (not a multiple of %d)", in_features, g, group_size)
        return g

    input_scales = {}
    kernel = int8_matmuls(model.embed_tokens.weight.device) if method == "w8a8_int8" else None
    smooth = kernel is not None and model.config.architecture == "llama"
    if kernel is not None and not smooth:  # (the scales fold into Llama's norm layout only, as AWQ's)
        log.info("w8a8_int8: a %s model is not smoothed (SmoothQuant's scales fold into Llama's norms)",
                 model.config.architecture)
    if method == "awq" or smooth:
        from pdserve.engine.quant.awq import CALIBRATION_TEXT, apply_awq, apply_smoothquant

        if calibration_ids is None:
            ids = tokenizer.encode(CALIBRATION_TEXT)
            calibration_ids = torch.tensor(ids, dtype=torch.long) % model.config.vocab_size
        calibration_ids = calibration_ids.to(model.embed_tokens.weight.device)
        if method == "awq":
            input_scales = apply_awq(model, calibration_ids, group_of)
        else:
            input_scales = apply_smoothquant(model, calibration_ids, weight_levels(kernel))
    for i in range(len(model.layers)):
        for suffix in LAYER_LINEARS:
            name = f"layers.{i}.{suffix}"
            weight = model.get_submodule(name).weight.detach()
            if method == "int8":
                new = Int8Linear(weight)
            elif method == "w8a8_int8":
                new = W8A8Linear(weight)
            elif method in ("int4", "awq"):
                new = Int4Linear(weight, group_of(weight.shape[1]))
            else:
                new = Fp8Linear(weight)
            if name in input_scales:
                new.set_input_scale(input_scales[name])
            _swap(model, name, new)
    if method != "fp8" and _block_head(model):
        from pdserve.engine.quant.gguf_native import q8_0_head, use_block_head

        use_block_head(model, q8_0_head(model.lm_head.weight))


def _block_head(model) -> bool:
    """Whether the output head multiplies from GGUF blocks: on CPU, where their C kernels are;
    Gemma 3's head stays float (not measured with them)."""
    return model.embed_tokens.weight.device.type == "cpu" and model.config.architecture == "llama"


def _swap(model, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def weight_bytes(model) -> int:
    """Bytes of every parameter and buffer that holds weights (a tied tensor once; RoPE's table excluded),
    and of the copies modules keep in oneDNN's opaque layouts (``packed_bytes``)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rope.") or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total + sum(getattr(m, "packed_bytes", 0) for m in model.modules())
