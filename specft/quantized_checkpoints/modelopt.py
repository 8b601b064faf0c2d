"""NVIDIA ModelOpt's Hugging Face exports (``export_hf_checkpoint``): ``hf_quant_config.json``
beside the weights, ``quant_method: modelopt`` in config.json.

Supported here, as vLLM's ModelOpt FP8 method serves it: ``quant_algo: FP8``, FP8 E4M3
weights with one float32 scale per tensor (``weight * weight_scale``), and inputs
quantized with the calibrated per-tensor ``input_scale``: ``x * (1 / input_scale)``
clamped to +-448, cast to E4M3 (ties to even) and scaled back, in float32 (vLLM's static
FP8 kernel multiplies by the inverted scale). Modules in ``exclude_modules`` stay as
stored. Other algorithms (NVFP4, INT4 AWQ, W4A8) and KV-cache quantization are refused
in one line naming them.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import torch
from torch import nn

from specft.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    FormatFamily,
    LayerQuant,
    need,
    read_json,
    read_tensors,
)

CONFIG_FILE = "hf_quant_config.json"
SUPPORTED_ALGOS = ("FP8",)
FP8_MAX = 448.0
QUANT_TENSORS = ("weight_scale", "input_scale", "weight_scale_2", "k_scale", "v_scale")


def _tensor_scale(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    scale = need(tensors, key)
    if scale.numel() != 1:
        raise SpecftError(f"model.path: {key} has shape {list(scale.shape)}; FP8 per-tensor scales have one value")
    return scale.reshape(()).to(torch.float32)


class StaticFp8Input:
    """An FP8 per-tensor input with the checkpoint's calibrated scale."""

    share_key = None  # static: each layer its own scale

    def __init__(self, scale: torch.Tensor):
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes = (x.to(torch.float32) * (1 / self.scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (codes.to(torch.float32) * self.scale).to(x.dtype)


class ModelOpt(FormatFamily):
    name = "modelopt"
    packs = True
    description_files = (CONFIG_FILE,)

    def detect(self, model_dir: Path) -> bool:
        return (model_dir / CONFIG_FILE).is_file()

    def open(self, model_dir: Path) -> CheckpointQuant:
        quant = read_json(model_dir / CONFIG_FILE).get("quantization") or {}
        algo = quant.get("quant_algo")
        if algo not in SUPPORTED_ALGOS:
            raise SpecftError(f"quant=checkpoint: ModelOpt quant_algo {algo} is not supported yet; supported: "
                              f"{', '.join(SUPPORTED_ALGOS)} (docs/checkpoints.md)")
        if quant.get("kv_cache_quant_algo"):
            raise SpecftError(f"quant=checkpoint: this ModelOpt checkpoint quantizes the KV cache "
                              f"({quant['kv_cache_quant_algo']}), which specft cannot run from a checkpoint yet")
        ckpt = CheckpointQuant(self.name, model_dir, f"{algo}: fp8 tensor weights, fp8 tensor static inputs",
                               list(quant.get("exclude_modules") or []))
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, model, dtype)
        return ckpt

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        return 8.0  # FP8 codes, one scale per tensor

    def _load_state(self, ckpt: CheckpointQuant, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raw = read_tensors(ckpt.model_dir, "model*.safetensors")
        state = {k: v.to(dtype) for k, v in raw.items()
                 if v.is_floating_point() and v.dtype != torch.float8_e4m3fn and not k.endswith(QUANT_TENSORS)}
        for name, module in model.named_modules():
            weight = raw.get(f"{name}.weight")
            if not isinstance(module, nn.Linear) or weight is None or weight.dtype != torch.float8_e4m3fn:
                continue
            if any(fnmatch(name, p) for p in ckpt.ignored):
                raise SpecftError(f"model.path: {name} is in exclude_modules but its weight is FP8")
            stored = {"weight": weight, "weight_scale": _tensor_scale(raw, f"{name}.weight_scale")}
            ckpt.put_weight(state, name, module, stored,
                            lambda t: t["weight"].to(torch.float32) * t["weight_scale"], dtype)
            quantize_input = StaticFp8Input(_tensor_scale(raw, f"{name}.input_scale"))
            ckpt.layers[name] = LayerQuant(name, "fp8 tensor", "fp8 tensor static", quantize_input)
        stray = sorted(k for k, v in raw.items() if v.dtype == torch.float8_e4m3fn and k.rsplit(".", 1)[0]
                       not in ckpt.layers)
        if stray:
            raise SpecftError(f"model.path: {stray[0]} is FP8, but the model has no such linear layer")
        return state


CHECKPOINT_FORMATS.register("modelopt")(ModelOpt())
