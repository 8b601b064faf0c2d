"""gpt-oss's own MXFP4 checkpoints (``quant_method: mxfp4``; openai/gpt-oss-20b / -120b).

Only the Mixture-of-Experts projections are quantized, each stored as the Linear it is
([E, out, in]): ``<proj>_blocks`` [E, out, in / 32, 16] holds two E2M1 codes a byte, the
low nibble first, and ``<proj>_scales`` [E, out, in / 32] one E8M0 exponent (bias 127) per
group of 32 inputs. The dense weight is each code's E2M1 value times 2^(scale - 127), laid
out as transformers' GptOssExperts keeps it ([E, in, out]: the transpose), as
transformers' own reader (``Mxfp4Config(dequantize=True)``) does. Activations stay 16-bit:
the weight-only MXFP4 path engines serve gpt-oss with on Hopper and older GPUs, so the
experts run as transformers runs them. Attention, router, embeddings and head are stored
in bfloat16 (``modules_to_not_convert``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specft.common.errors import SpecftError
from specft.quant.model_hooks import full_shape
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    LayerQuant,
    QuantMethodFamily,
    need,
    read_tensors,
)
from specft.quantized_checkpoints.compressed_tensors import unpack_fp4

GROUP = 32
PROJECTIONS = ("gate_up_proj", "down_proj")
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str,
                     shape: tuple[int, int, int]) -> torch.Tensor:
    """The float32 weight [E, in, out] of experts stored as [E, out, in] MXFP4 (``shape``:
    the parameter's [E, in, out])."""
    experts, inp, out = shape
    want = ((experts, out, inp // GROUP, GROUP // 2), (experts, out, inp // GROUP))
    if (tuple(blocks.shape), tuple(scales.shape)) != want:
        raise SpecftError(f"model.path: {name}_blocks / {name}_scales have shapes {list(blocks.shape)} / "
                          f"{list(scales.shape)}, but MXFP4 experts of shape {list(shape)} need {list(want[0])} / "
                          f"{list(want[1])}")
    values = unpack_fp4(blocks).to(torch.float32)  # [E, out, in / 32, 32]: exact E2M1 values
    weight = values * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return weight.flatten(-2).transpose(1, 2)


class GptOssMxfp4(QuantMethodFamily):
    name, method = "gpt-oss-mxfp4", "mxfp4"

    def open(self, model_dir: Path) -> CheckpointQuant:
        qcfg = self.quantization_config(model_dir)
        ckpt = CheckpointQuant(self.name, model_dir, "mxfp4: e2m1 group 32 expert weights (e8m0 scales), 16-bit inputs",
                               list(qcfg.get("modules_to_not_convert") or []))
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, model, dtype)
        return ckpt

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        return None  # only the experts are MXFP4: plan counts every Linear at one width

    def _load_state(self, ckpt: CheckpointQuant, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raw = read_tensors(ckpt.model_dir, "model*.safetensors")
        state = {k: raw[k].to(dtype) for k in raw if not k.endswith(SUFFIXES)}
        for name, module in model.named_modules():
            for proj in PROJECTIONS:
                key = f"{name}.{proj}"
                if f"{key}_blocks" not in raw:
                    continue
                param = getattr(module, proj, None)
                if not isinstance(param, torch.Tensor) or len(full_shape(param)) != 3:
                    raise SpecftError(f"model.path: {key}_blocks is MXFP4, but the model has no such experts")
                blocks, scales = need(raw, f"{key}_blocks"), need(raw, f"{key}_scales")
                state[key] = dequantize_mxfp4(blocks, scales, key, full_shape(param)).to(dtype)
                ckpt.layers[key] = LayerQuant(key, "mxfp4 group 32", None)
        stray = sorted(k for k in raw if k.endswith(SUFFIXES) and k.rsplit("_", 1)[0] not in ckpt.layers)
        orphans = [k for k in stray if k.endswith("_scales") and f"{k[:-len('_scales')]}_blocks" not in raw]
        if orphans:
            raise SpecftError(f"model.path: {orphans[0]} is stored without its {orphans[0][:-len('_scales')]}_blocks; "
                              "the checkpoint is incomplete: download it again")
        if stray:
            raise SpecftError(f"model.path: {stray[0]} belongs to no MXFP4 experts of the model")
        return state


CHECKPOINT_FORMATS.register("gpt-oss-mxfp4")(GptOssMxfp4())
