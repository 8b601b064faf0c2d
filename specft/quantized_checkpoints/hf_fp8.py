"""Hugging Face's fine-grained FP8 checkpoints: ``quantization_config.quant_method == "fp8"``,
the format of Qwen's own Qwen3-*-FP8 releases (and DeepSeek-V3's).

Weights: FP8 E4M3 codes with one float32 ``weight_scale_inv`` per ``weight_block_size``
block (Qwen: 128 x 128), dense weight = ``code * scale_inv`` broadcast over its block, in
float32, then the model's dtype: transformers' dequantization (``FineGrainedFP8Config(
dequantize=True)``) and compressed-tensors' FP8_BLOCK do the same arithmetic.

Activations (``activation_scheme: dynamic``), as vLLM serves the format
(``per_token_group_quant_fp8``): each token's input in groups of ``weight_block_size[1]``,
in float32, scale ``max(amax, 1e-10) / 448``, codes ``x / scale`` clamped to +-448 and cast
to E4M3 (ties to even). In float32 that is bit for bit compressed-tensors' dynamic FP8
group quantization (amax / 448, a zero group's scale an eps: the codes are 0 either way).

Layers in ``modules_to_not_convert`` (and any whose weight is not FP8, such as lm_head)
stay as stored. Other activation schemes and formats are refused in one line.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import torch
from torch import nn

from specft.common.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    LayerQuant,
    QuantMethodFamily,
    need,
    read_tensors,
)
from specft.quantized_checkpoints.compressed_tensors import (
    CTArgs,
    broadcast_scale,
    expected_scale_shape,
)

QUANT_METHOD = "fp8"
FP8_MAX = 448.0
MIN_AMAX = 1e-10  # vLLM's eps under a group's amax
SCALE = "weight_scale_inv"
ACTIVATION_SCHEMES = ("dynamic",)


class TokenGroupFp8Input:
    """A Linear's input in FP8, per token in groups of ``group`` channels, dynamic."""

    def __init__(self, group: int):
        self.group = group
        self.share_key = ("hf-fp8", group)  # q/k/v read one tensor: quantize it once

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % self.group:
            raise SpecftError(f"quant=checkpoint: an input of width {x.shape[-1]} does not split into FP8 groups "
                              f"of {self.group}")
        g = x.to(torch.float32).unflatten(-1, (-1, self.group))
        scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
        codes = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (codes.to(torch.float32) * scale).flatten(-2).to(x.dtype)


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str) -> torch.Tensor:
    """The float32 weight of one layer: each block's codes times its scale, broadcast as
    compressed-tensors' FP8_BLOCK broadcasts its block scales (the same arithmetic)."""
    shape = tuple(weight.shape)
    args = CTArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=block)
    want = expected_scale_shape(args, *shape)
    if tuple(scale_inv.shape) != want:
        raise SpecftError(f"model.path: {name}.{SCALE} has shape {list(scale_inv.shape)}, but {block[0]}x{block[1]} "
                          f"blocks of a {list(shape)} weight need {list(want)}")
    return weight.to(torch.float32) * broadcast_scale(scale_inv.to(torch.float32), args, shape)


class HfFp8(QuantMethodFamily):
    name, method = "hf-fp8", QUANT_METHOD
    packs = True

    def open(self, model_dir: Path) -> CheckpointQuant:
        qcfg = self.quantization_config(model_dir)
        scheme, fmt, block = qcfg.get("activation_scheme"), qcfg.get("fmt", "e4m3"), qcfg.get("weight_block_size")
        if scheme not in ACTIVATION_SCHEMES:
            raise SpecftError(f"quant=checkpoint: FP8 activation_scheme {scheme!r} is not supported yet; "
                              f"supported: {', '.join(ACTIVATION_SCHEMES)} (docs/checkpoints.md)")
        if fmt != "e4m3":
            raise SpecftError(f"quant=checkpoint: FP8 fmt {fmt!r} is not supported yet; supported: e4m3")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise SpecftError(f"quant=checkpoint: FP8 weight_block_size {block!r} is not supported; specft runs "
                              "block-wise FP8 ([rows, columns], e.g. [128, 128])")
        block = (block[0], block[1])
        summary = f"fp8: e4m3 block {block[0]}x{block[1]} weights, fp8 token group {block[1]} dynamic inputs"
        ckpt = CheckpointQuant(self.name, model_dir, summary, list(qcfg.get("modules_to_not_convert") or []))
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, block, model, dtype)
        return ckpt

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        block = qcfg.get("weight_block_size") or [1, 1]
        return 8 + 32 / (block[0] * block[1])  # a float32 scale per block

    def _excluded(self, ckpt: CheckpointQuant, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") or fnmatch(name, p) for p in ckpt.ignored)

    def _load_state(self, ckpt: CheckpointQuant, block: tuple[int, int], model: nn.Module,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raw = read_tensors(ckpt.model_dir, "model*.safetensors")
        state = {k: raw[k].to(dtype) for k in raw
                 if raw.dtype(k).is_floating_point and raw.dtype(k) != torch.float8_e4m3fn
                 and not k.endswith("." + SCALE)}
        quantize_input = TokenGroupFp8Input(block[1])
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or raw.get_dtype(f"{name}.weight") != torch.float8_e4m3fn:
                continue
            if self._excluded(ckpt, name):
                raise SpecftError(f"model.path: {name} is in modules_to_not_convert but its weight is FP8")
            stored = {"weight": raw[f"{name}.weight"], SCALE: need(raw, f"{name}.{SCALE}")}
            ckpt.put_weight(state, name, module, stored,
                            lambda t, n=name: dequantize_block_fp8(t["weight"], t[SCALE], block, n), dtype)
            ckpt.layers[name] = LayerQuant(name, f"fp8 block {block[0]}x{block[1]}",
                                           f"fp8 token group {block[1]} dynamic", quantize_input)
        stray = sorted(k for k in raw if (raw.dtype(k) == torch.float8_e4m3fn or k.endswith("." + SCALE))
                       and k.rsplit(".", 1)[0] not in ckpt.layers)
        if stray:  # its codes would otherwise be read as 16-bit weights, or its scale dropped
            raise SpecftError(f"model.path: {stray[0]} belongs to no FP8 linear layer of the model")
        return state


CHECKPOINT_FORMATS.register("hf-fp8")(HfFp8())
