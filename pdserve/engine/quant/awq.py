"""AWQ (activation-aware weight quantization, Lin et al. 2023) for int4 weights, and SmoothQuant's
smoothing (Xiao et al. 2023) for ``w8a8_int8``: the same per-input-channel scales, chosen otherwise.

A few input channels carry much larger activations than the rest; their weights matter more.
AWQ scales each input channel of a weight by ``s = a ** alpha`` (``a``: the channel's mean
``|x|`` on calibration text) before quantising, and divides the activation by ``s``, so
``x W^T = (x / s)(W s)^T`` exactly in float while the salient columns lose less to rounding.
``alpha`` is searched per layer on a grid (0 = plain int4, so AWQ never does worse than plain
int4 on the calibration activations) for the smallest output error.

Where ``1 / s`` goes (no run-time cost except for o_proj)::

    input_layernorm.weight          / s_qkv   -> qkv_proj columns      * s_qkv
    post_attention_layernorm.weight / s_gu    -> gate_up_proj columns  * s_gu
    up rows of gate_up_proj         / s_down  -> down_proj columns     * s_down   (silu(g) * u is linear in u)
    the activation, at run time     * 1/s_o   -> o_proj columns        * s_o      (GQA: v rows cannot absorb it)

SmoothQuant moves the activations' outlier channels into the weights, where int8's per-row scales
absorb them, before both are rounded to int8 per row: ``s = max|x_j| ** a / max|W_j| ** (1 - a)``,
``a`` searched on a grid per layer (no scaling among the candidates) for the smallest error of the
w8a8 product on the calibration activations (``smooth_scale``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.quant.formats import Int4Linear, quantize_int8

# The calibration text: mixed prose, dialogue, a list and code, so that the activations seen
# cover the kinds of input a chat model serves. Written for this project.
CALIBRATION_TEXT = """\
The river rose slowly through the night, and by morning the lower fields were under water.
Farmers moved their animals to the hills while the children watched from the church steps.
"Will it reach the mill?" asked the youngest. Her grandfather shook his head and said nothing.

User: Can you explain how a hash table handles collisions?
Assistant: A hash table maps each key to a bucket. When two keys land in the same bucket, the
table either keeps a short list in that bucket (chaining) or probes for the next free slot
(open addressing). Lookups stay fast as long as the table is not too full.

Shopping list: 2 kg of flour, 12 eggs, 500 g of butter, a jar of honey, 3 lemons.

def fibonacci(n: int) -> list[int]:
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]

In 1905 Einstein published four papers that changed physics: on the photoelectric effect,
Brownian motion, special relativity, and the equivalence of mass and energy, E = mc^2.
Les prix ont augmenté de 3,5 % en un an, selon l'institut national de la statistique.
"""


class CausalAttention:
    """Attention for one whole sequence, no KV cache: calibration and perplexity passes."""

    def forward(self, q, k, v, k_cache, v_cache, meta, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1) if out_dtype is None else out.transpose(0, 1).to(out_dtype)


@torch.inference_mode()
def full_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one sequence (positions from 0), without the paged cache."""
    positions = torch.arange(ids.shape[0], device=ids.device)
    caches = [(None, None)] * len(model.layers)
    hidden = model.forward(ids, positions, caches, meta=None, backend=CausalAttention())
    return model.compute_logits(hidden)


@torch.inference_mode()
def collect_inputs(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each layer Linear's input over the calibration tokens, keyed by module name."""
    inputs, hooks = {}, []
    for name, module in model.named_modules():
        if name.startswith("layers.") and name.rsplit(".", 1)[-1].endswith("_proj"):
            hooks.append(module.register_forward_hook(
                lambda m, args, out, name=name: inputs.__setitem__(name, args[0].detach().float())))
    try:
        full_forward(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def search_scale(weight: torch.Tensor, x: torch.Tensor, group: int, grid: int = 10) -> torch.Tensor:
    """The per-input-channel scale ``s`` minimising ``|x W^T - (x / s) Q(W s)^T|``."""
    w = weight.float()
    act = x.abs().mean(0).clamp(min=1e-6)
    ref = x @ w.t()
    best_err, best = float("inf"), torch.ones_like(act)
    for i in range(grid + 1):
        s = act.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (AWQ's normalisation)
        approx = Int4Linear.fake_quant(w * s, group) / s
        err = (x @ approx.t() - ref).pow(2).mean().item()
        if err < best_err:
            best_err, best = err, s
    return best


def _fake_int8_rows(t: torch.Tensor, levels: int = 127) -> torch.Tensor:
    q, scale = quantize_int8(t, levels)
    return q.float() * scale[:, None]


def smooth_scale(weight: torch.Tensor, x: torch.Tensor, grid: int = 4, weight_levels: int = 127,
                 rows: int = 128) -> torch.Tensor:
    """SmoothQuant's per-input-channel scale ``s`` minimising ``|x W^T - Q(x / s) Q(W s)^T|`` with
    ``Q`` w8a8's rounding (int8, one scale per row of each; the weight to ``weight_levels``, 63 for
    the 7-bit copy of oneDNN's qlinear), ``s = 1`` among the candidates: ``s = max|x|^a / max|W|^(1-a)``
    for ``a`` in ``grid + 1`` steps from 0 to 1, the error measured on ``rows`` of x spread over it
    (the maxima over all of them). The defaults, measured on the default model with 7-bit weights
    (AVX2's qlinear; perplexity over 1,023 tokens, float32 19.743): grid 10 over all 297 calibration
    rows 20.485, grid 5 over 128 rows 20.610, grid 4 over 128 19.793 (over 64: 19.767), grid 2
    20.292, no smoothing 22.787; the search is layer by layer, so a finer grid is not a better model."""
    w = weight.float()
    x_max, w_max = x.abs().amax(0).clamp(min=1e-5), w.abs().amax(0).clamp(min=1e-5)
    if rows and x.shape[0] > rows:
        x = x[torch.linspace(0, x.shape[0] - 1, rows).long()]
    ref = x @ w.t()
    best = torch.ones_like(x_max)
    best_err = (_fake_int8_rows(x) @ _fake_int8_rows(w, weight_levels).t() - ref).pow(2).mean().item()
    for i in range(grid + 1):
        a = i / grid
        s = x_max.pow(a) / w_max.pow(1 - a)
        s = s / (s.max() * s.min()).sqrt()
        err = (_fake_int8_rows(x / s) @ _fake_int8_rows(w * s, weight_levels).t() - ref).pow(2).mean().item()
        if err < best_err:
            best_err, best = err, s
    return best


@torch.inference_mode()
def apply_awq(model, calibration_ids: torch.Tensor, group_of) -> dict[str, torch.Tensor]:
    """Scale the float model's weights in place (see the module docstring); returns o_proj's ``1/s``
    per layer (the scales no previous op absorbs). ``group_of(in_features)`` is the group size used."""
    return apply_input_scales(model, calibration_ids, lambda w, x: search_scale(w, x, group_of(w.shape[1])))


@torch.inference_mode()
def apply_smoothquant(model, calibration_ids: torch.Tensor, weight_levels: int = 127) -> dict[str, torch.Tensor]:
    """``apply_awq`` with SmoothQuant's scales (``smooth_scale``), for int8 weights and activations."""
    return apply_input_scales(model, calibration_ids,
                              lambda w, x: smooth_scale(w, x, weight_levels=weight_levels))


@torch.inference_mode()
def apply_input_scales(model, calibration_ids: torch.Tensor, search) -> dict[str, torch.Tensor]:
    """Fold ``search(weight, inputs)``'s per-input-channel scales into the float model's weights in place
    (see the module docstring); returns o_proj's ``1/s`` per layer (the scales no previous op absorbs)."""
    inputs = collect_inputs(model, calibration_ids)
    runtime = {}
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        s = search(attn.qkv_proj.weight, inputs[p + "self_attn.qkv_proj"])
        layer.input_layernorm.weight.div_(s)
        attn.qkv_proj.weight.mul_(s)
        s = search(attn.o_proj.weight, inputs[p + "self_attn.o_proj"])
        attn.o_proj.weight.mul_(s)
        runtime[p + "self_attn.o_proj"] = 1.0 / s
        s = search(mlp.gate_up_proj.weight, inputs[p + "mlp.gate_up_proj"])
        layer.post_attention_layernorm.weight.div_(s)
        mlp.gate_up_proj.weight.mul_(s)
        s = search(mlp.down_proj.weight, inputs[p + "mlp.down_proj"])
        mlp.gate_up_proj.weight[mlp.intermediate :].div_(s[:, None])
        mlp.down_proj.weight.mul_(s)
    return runtime
