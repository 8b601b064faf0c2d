"""Quantized weight tensors as serving engines store them (compressed-tensors names):

- FP8: ``weight`` float8_e4m3fn [out, in] and ``weight_scale`` float32 [out, 1]
  (per-channel), format ``float-quantized``.
- MXFP4: ``weight_packed`` uint8 [out, in/2], two E2M1 codes per byte (element 2i in the
  low nibble, 2i+1 in the high one), and ``weight_scale`` uint8 [out, in/32], the E8M0
  exponent biased by 127; format ``mxfp4-pack-quantized``.

The values are exactly specft's fake quantization (same scale rule), so a dequantized
export equals the QAT draft's weights bit for bit.
"""

from __future__ import annotations

import torch

from specft.common.errors import SpecftError
from specft.quant.fake_quant import TensorQuantSpec, quantized_parts

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127


def pack_fp8_channel(w: torch.Tensor, spec: TensorQuantSpec) -> dict[str, torch.Tensor]:
    if spec.format != "e4m3" or spec.scheme != "channel":
        raise SpecftError(f"export: FP8 export needs e4m3 per-channel weights, got {spec.format}/{spec.scheme}")
    elements, scale = quantized_parts(w.float(), spec)
    return {"weight": elements.to(torch.float8_e4m3fn), "weight_scale": scale.float().reshape(-1, 1)}


def _e2m1_codes(elements: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=elements.dtype)
    index = (elements.abs()[..., None] == table).float().argmax(-1)
    return (index | ((elements < 0) | ((elements == 0) & torch.signbit(elements))).long() << 3).to(torch.uint8)


def pack_mxfp4(w: torch.Tensor, spec: TensorQuantSpec) -> dict[str, torch.Tensor]:
    if spec.format != "e2m1" or spec.scheme != "mx" or spec.block_size != 32:
        raise SpecftError(f"export: MXFP4 export needs e2m1 mx weights in blocks of 32, got "
                          f"{spec.format}/{spec.scheme}/{spec.block_size}")
    out_features, in_features = w.shape
    if in_features % 32:
        raise SpecftError(f"export: MXFP4 needs in_features divisible by 32, got {in_features}")
    elements, scale = quantized_parts(w.float(), spec)  # [out, in/32, 32], [out, in/32, 1]
    codes = _e2m1_codes(elements).reshape(out_features, in_features)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    exponent = torch.log2(scale.squeeze(-1)).round().long() + E8M0_BIAS
    return {"weight_packed": packed, "weight_scale": exponent.to(torch.uint8)}


PACKERS = {"fp8": pack_fp8_channel, "mxfp4": pack_mxfp4}


def compressed_tensors_config(kind: str, ignore: list[str], activation: TensorQuantSpec | None) -> dict:
    """The `quantization_config` block of config.json for the exported draft."""
    weights = ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
               if kind == "fp8" else
               {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                "dynamic": False, "scale_dtype": "float8_e8m0fnu"})
    group = {"targets": ["Linear"], "weights": weights}
    if activation is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": activation.scheme,
                                      "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors",
            "format": "float-quantized" if kind == "fp8" else "mxfp4-pack-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignore}
