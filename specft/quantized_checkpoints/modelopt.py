"""NVIDIA ModelOpt's Hugging Face exports (``export_hf_checkpoint``): ``hf_quant_config.json``
beside the weights, ``quant_method: modelopt`` in config.json.

Supported here, as vLLM's ModelOpt methods serve them:

- ``quant_algo: FP8``: FP8 E4M3 weights with one float32 scale per tensor (``weight *
  weight_scale``), and inputs quantized with the calibrated per-tensor ``input_scale``:
  ``x * (1 / input_scale)`` clamped to +-448, cast to E4M3 (ties to even) and scaled
  back, in float32 (vLLM's static FP8 kernel multiplies by the inverted scale).
- ``quant_algo: NVFP4``: E2M1 weights two to a byte (low nibble first) in groups of
  ``group_size`` (16), each group's E4M3 ``weight_scale`` times the tensor's float32
  ``weight_scale_2``: ``value * (weight_scale * weight_scale_2)`` in float32, as
  ModelOpt's NVFP4QTensor.dequantize does. Inputs in FP4 groups of 16 with dynamic E4M3
  group scales under the global scale ``1 / input_scale`` (vLLM passes the inverted
  calibrated scale to its FP4 quantizer): compressed-tensors' NVFP4 input arithmetic,
  which specft runs bit-equal to that library (compressed_tensors.InputQuantizer).

With ``kv_cache_quant_algo: FP8`` the keys (after RoPE) and values every attention reads
are rounded as vLLM's FP8 KV cache stores them: per layer, the calibrated ``k_proj.k_scale``
and ``v_proj.v_scale`` (amax / 448) as static per-tensor FP8 scales, the input arithmetic
above; ModelOpt's own fake-quant forward (its k/v_bmm_quantizers) is the oracle.

Modules in ``exclude_modules`` stay as stored. Other algorithms (INT4 AWQ, W4A8) and other
KV-cache schemes are refused in one line naming them.
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
    FormatFamily,
    LayerQuant,
    need,
    read_json,
    read_tensors,
)
from specft.quantized_checkpoints.compressed_tensors import CTArgs, InputQuantizer, unpack_fp4

CONFIG_FILE = "hf_quant_config.json"
SUPPORTED_ALGOS = ("FP8", "NVFP4")
SUPPORTED_KV_ALGOS = ("FP8",)
NVFP4_ELEMENTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "dynamic": True}
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


class Fp8KvCache:
    """Keys and values rounded to FP8 with their layer's calibrated scales, as an FP8 KV
    cache stores them (an attention step: quant.model_hooks.install_attention_transform).
    Static scales make it idempotent, so keys read back from a cache round to themselves."""

    takes_module = True
    description = "fp8 kv cache: per-layer static k_scale / v_scale"

    def __init__(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.quantizers = {layer: (StaticFp8Input(k), StaticFp8Input(v)) for layer, (k, v) in scales.items()}

    def __call__(self, query, key, value, module):
        quant_k, quant_v = self.quantizers[module.layer_idx]
        return query, quant_k(key), quant_v(value)


def _kv_cache(raw, model: nn.Module) -> Fp8KvCache:
    """Each attention layer's k_scale and v_scale (ModelOpt writes them under k_proj /
    v_proj; under the attention module itself in some exports)."""
    scales = {}
    for name, module in model.named_modules():
        if not hasattr(module, "layer_idx") or not isinstance(getattr(module, "k_proj", None), nn.Module):
            continue
        found = [next((k for k in (f"{name}.{proj}.{s}", f"{name}.{s}") if k in raw), f"{name}.{proj}.{s}")
                 for proj, s in (("k_proj", "k_scale"), ("v_proj", "v_scale"))]
        scales[module.layer_idx] = tuple(_tensor_scale(raw, key) for key in found)
    return Fp8KvCache(scales)


class ModelOpt(FormatFamily):
    name = "modelopt"
    packs = True
    description_files = (CONFIG_FILE,)
    methods = ("modelopt",)

    def detect(self, model_dir: Path) -> bool:
        return (model_dir / CONFIG_FILE).is_file()

    def open(self, model_dir: Path) -> CheckpointQuant:
        quant = read_json(model_dir / CONFIG_FILE).get("quantization") or {}
        algo = quant.get("quant_algo")
        if algo not in SUPPORTED_ALGOS:
            raise SpecftError(f"quant=checkpoint: ModelOpt quant_algo {algo} is not supported yet; supported: "
                              f"{', '.join(SUPPORTED_ALGOS)} (docs/checkpoints.md)")
        kv_algo = quant.get("kv_cache_quant_algo")
        if kv_algo and kv_algo not in SUPPORTED_KV_ALGOS:
            raise SpecftError(f"quant=checkpoint: this ModelOpt checkpoint quantizes the KV cache as {kv_algo}, "
                              f"which specft cannot run from a checkpoint yet; supported: "
                              f"{', '.join(SUPPORTED_KV_ALGOS)}")
        if algo == "NVFP4":
            group = int(quant.get("group_size") or 16)
            if group != 16:
                raise SpecftError(f"quant=checkpoint: ModelOpt NVFP4 group_size {group} is not supported; NVFP4 "
                                  "groups are 16")
            summary = "NVFP4: fp4 group 16 weights (fp8 group scales, fp32 tensor scale), fp4 group 16 dynamic inputs"
        else:
            summary = f"{algo}: fp8 tensor weights, fp8 tensor static inputs"
        summary += ", fp8 kv cache" if kv_algo else ""
        ckpt = CheckpointQuant(self.name, model_dir, summary, list(quant.get("exclude_modules") or []))
        load = self._load_nvfp4 if algo == "NVFP4" else self._load_state

        def load_state(model, dtype):
            raw = read_tensors(model_dir, "model*.safetensors")
            state = load(ckpt, raw, model, dtype)
            if kv_algo:
                ckpt.attention.append(_kv_cache(raw, model))
            return state

        ckpt.load_state = load_state
        return ckpt

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        # config.json's quantization_config names the algorithm as hf_quant_config.json does
        if qcfg.get("quant_algo") == "NVFP4":
            return 4 + 8 / 16  # E2M1 codes, an E4M3 scale per 16
        return 8.0  # FP8 codes, one scale per tensor

    def _load_state(self, ckpt: CheckpointQuant, raw, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        state = {k: raw[k].to(dtype) for k in raw
                 if raw.dtype(k).is_floating_point and raw.dtype(k) != torch.float8_e4m3fn
                 and not k.endswith(QUANT_TENSORS)}
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or raw.get_dtype(f"{name}.weight") != torch.float8_e4m3fn:
                continue
            if any(fnmatch(name, p) for p in ckpt.ignored):
                raise SpecftError(f"model.path: {name} is in exclude_modules but its weight is FP8")
            stored = {"weight": raw[f"{name}.weight"], "weight_scale": _tensor_scale(raw, f"{name}.weight_scale")}
            ckpt.put_weight(state, name, module, stored,
                            lambda t: t["weight"].to(torch.float32) * t["weight_scale"], dtype)
            quantize_input = StaticFp8Input(_tensor_scale(raw, f"{name}.input_scale"))
            ckpt.layers[name] = LayerQuant(name, "fp8 tensor", "fp8 tensor static", quantize_input)
        stray = sorted(k for k in raw if raw.dtype(k) == torch.float8_e4m3fn and k.rsplit(".", 1)[0]
                       not in ckpt.layers)
        if stray:
            raise SpecftError(f"model.path: {stray[0]} is FP8, but the model has no such linear layer")
        return state


    def _load_nvfp4(self, ckpt: CheckpointQuant, raw, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        quantized = {k[: -len(".weight_scale_2")] for k in raw if k.endswith(".weight_scale_2")}
        state = {k: raw[k].to(dtype) for k in raw if raw.dtype(k).is_floating_point
                 and raw.dtype(k) != torch.float8_e4m3fn and not k.endswith(QUANT_TENSORS)
                 and k.rsplit(".", 1)[0] not in quantized}
        args = CTArgs.parse({**NVFP4_ELEMENTS, "group_size": 16}, "NVFP4 inputs")
        for name, module in model.named_modules():
            if name not in quantized:
                continue
            if not isinstance(module, nn.Linear):
                raise SpecftError(f"model.path: {name} is NVFP4, but the model has no such linear layer")
            stored = {"weight": need(raw, f"{name}.weight"), "weight_scale": need(raw, f"{name}.weight_scale"),
                      "weight_scale_2": _tensor_scale(raw, f"{name}.weight_scale_2")}
            ckpt.put_weight(state, name, module, stored, lambda t, m=module, n=name: _nvfp4_weight(t, m, n), dtype)
            # shaped [1] as compressed-tensors stores its global scale: a 0-d float32 scalar would
            # not promote bfloat16 inputs, and the group scales must be made in float32
            global_scale = (1 / _tensor_scale(raw, f"{name}.input_scale")).reshape(1)
            ckpt.layers[name] = LayerQuant(name, "nvfp4 group 16", "fp4 group 16 dynamic",
                                           InputQuantizer(args, global_scale=global_scale))
        stray = sorted(k for k in quantized if k not in ckpt.layers)
        if stray:
            raise SpecftError(f"model.path: {stray[0]} is NVFP4, but the model has no such linear layer")
        return state


def _nvfp4_weight(t: dict[str, torch.Tensor], module: nn.Linear, name: str) -> torch.Tensor:
    """The float32 weight: each code's E2M1 value times its group's scale, the scale the
    product of the group's E4M3 scale and the tensor's float32 one."""
    out, inp = module.out_features, module.in_features
    packed, scale = t["weight"], t["weight_scale"]
    if tuple(packed.shape) != (out, inp // 2) or tuple(scale.shape) != (out, inp // 16):
        raise SpecftError(f"model.path: {name}.weight / weight_scale have shapes {list(packed.shape)} / "
                          f"{list(scale.shape)}, but an NVFP4 [{out}, {inp}] weight needs [{out}, {inp // 2}] / "
                          f"[{out}, {inp // 16}]")
    values = unpack_fp4(packed).to(torch.float32)  # the same packing as compressed-tensors' (exact values)
    group_scale = scale.to(torch.float32) * t["weight_scale_2"]
    return (values.unflatten(-1, (-1, 16)) * group_scale.unsqueeze(-1)).flatten(-2)


CHECKPOINT_FORMATS.register("modelopt")(ModelOpt())
