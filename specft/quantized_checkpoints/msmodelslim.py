"""msModelSlim checkpoints in its "ascendV1" layout (Ascend's quantizer; what vllm-ascend
and MindIE serve): ``quant_model_description*.json`` names each tensor's scheme, the
weights sit in ``quant_model_weights*.safetensors``.

Supported here, as vllm-ascend serves them:

- ``W8A8_DYNAMIC``: INT8 weights per output channel (``weight_scale``, ``weight_offset``;
  or per group when the description gives a ``group_size``), activations quantized per
  token at run time, symmetric: ``scale = max(amax / 127, eps32)``, ``q = round(x / scale)``
  clamped to [-128, 127] (msModelSlim's own per-token arithmetic,
  msmodelslim/ir/api/impl/int_quantization.py).
- ``W8A8`` (static): INT8 weights, a per-tensor activation scale and integer offset from
  calibration. vllm-ascend runs ``npu_quant_matmul(q, w, deq_scale, bias=quant_bias)``
  with ``q = round(x * (1 / input_scale) + input_offset)``: the output is
  ``deq_scale * (q @ w.T + quant_bias)``, where msModelSlim folded the offset's correction
  (``-offset * sum(w)``) and any bias into ``quant_bias``. specft computes the same, the
  integer sum exactly (``torch._int_mm``), then the float32 product with ``deq_scale``.
  ``deq_scale`` is float32, or its bits stored as int64 (msModelSlim does so unless the
  model is bfloat16).
- ``FLOAT``: kept as stored.

- ``W4A8_DYNAMIC`` (per channel): INT4 weights packed two to an int8 along the output
  dim, ``code * weight_scale``; inputs as W8A8_DYNAMIC's. ``scale_bias`` is the NPU
  kernel's correction for its unsigned INT4 trick and changes no product.

Offline QuaRot (rotations folded into the weights, R1 saved under ``optional/``) runs as
the ordinary checkpoint it is. Other schemes (W4A8 in groups, W8A16, W4A4, MX, KV-cache
C8, sparse) and online rotations are refused in one line naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
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
    read_config,
    read_json,
    read_tensors,
)

DESCRIPTION_GLOB = "quant_model_description*.json"
EPS32 = torch.finfo(torch.float32).eps
INT8_MIN, INT8_MAX = -128.0, 127.0


def _check_shape(t: torch.Tensor, want: tuple[int, ...], key: str) -> None:
    if t.numel() != int(torch.Size(want).numel()):
        raise SpecftError(f"model.path: {key} has shape {list(t.shape)}, expected {list(want)}")


def deq_scale_float32(t: torch.Tensor) -> torch.Tensor:
    """msModelSlim stores ``deq_scale`` as float32, or (models not in bfloat16) as the
    float32's bit pattern widened to int64."""
    if t.dtype == torch.int64:
        return t.to(torch.int32).view(torch.float32)
    return t.to(torch.float32)


# -- activations --------------------------------------------------------------------------

class PerTokenInt8:
    """W8A8_DYNAMIC inputs: symmetric INT8 per token, scale from each token's amax."""

    share_key = ("msmodelslim", "int8 token dynamic")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.max(amax / INT8_MAX, torch.tensor(EPS32, dtype=x.dtype))
        return torch.round(x / scale).clamp(INT8_MIN, INT8_MAX) * scale


@dataclass
class StaticInt8Codes:
    """W8A8 inputs: the INT8 codes ``round(x * (1 / scale) + offset)``, the scale in the
    activation's dtype, as vllm-ascend's ``npu_quantize`` computes them (div_mode=False).
    msModelSlim's own quantize divides (``divide``), as the fused RMSNorm+quantize kernel
    does; the two differ where x / scale lands within a rounding error of a half."""

    scale: torch.Tensor
    offset: torch.Tensor
    divide = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.to(x.dtype)
        scaled = x / scale if self.divide else x * (1 / scale)
        return torch.round(scaled + self.offset.to(x.dtype)).clamp(INT8_MIN, INT8_MAX)


@cache
def _int_mm_runs() -> bool:
    """Whether this build and CPU run ``torch._int_mm`` (probed once, not per call)."""
    try:
        torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 x int8 -> int32 matmul: ``torch._int_mm`` where this build and CPU run it,
    else float64, which is exact for these sums (|sum| < 2**53)."""
    if _int_mm_runs():
        return torch._int_mm(a, b)
    return (a.double() @ b.double()).to(torch.int32)


class StaticInt8Linear:
    """A W8A8 layer as ``npu_quant_matmul`` computes it: the integer sum of codes times
    INT8 weights, plus ``quant_bias``, exactly (int32), then times ``deq_scale`` in float32."""

    def __init__(self, codes: StaticInt8Codes, weight: torch.Tensor, quant_bias: torch.Tensor, deq: torch.Tensor):
        self.codes, self.weight_t = codes, weight.to(torch.int8).t().contiguous()
        self.quant_bias, self.deq = quant_bias.to(torch.int32), deq.to(torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.codes(x).to(torch.int8).reshape(-1, x.shape[-1])
        acc = int_matmul(q, self.weight_t) + self.quant_bias
        return (acc.to(torch.float32) * self.deq).to(x.dtype).reshape(*x.shape[:-1], -1)


# -- schemes ------------------------------------------------------------------------------

@dataclass
class Dense:
    """What one quantized layer becomes: the dense weight (what the layer multiplies by,
    for the state dict and reports) and how it computes."""

    weight: torch.Tensor
    weight_desc: str
    input_desc: str
    quantize_input: Callable[[torch.Tensor], torch.Tensor] | None = None  # before a plain Linear forward
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None  # instead of it


def _w8a8_dynamic(t: dict[str, torch.Tensor], name: str, shape: tuple[int, int], group_size: int) -> Dense:
    q = need(t, f"{name}.weight")
    scale, offset = need(t, f"{name}.weight_scale"), t.get(f"{name}.weight_offset")
    groups = shape[1] // group_size if group_size else 1
    _check_shape(scale, (shape[0], groups), f"{name}.weight_scale")
    scale = scale.to(torch.float32).reshape(shape[0], groups)
    offset = torch.zeros_like(scale) if offset is None else offset.to(torch.float32).reshape(shape[0], groups)
    width = shape[1] // groups
    dense = (q.to(torch.float32) - offset.repeat_interleave(width, 1)) * scale.repeat_interleave(width, 1)
    where = f"group {group_size}" if group_size else "channel"
    return Dense(dense, f"int8 {where}", "int8 token dynamic", quantize_input=PerTokenInt8())


def unpack_int4_pairs(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """msModelSlim's W4A8 packing: the weight transposed to [in, out], each pair of
    neighbouring outputs in one int8 (the even one in the low nibble), transposed back:
    [out / 2, in] bytes -> [out, in] signed INT4 codes."""
    p = packed.to(torch.int8).t()  # [in, out / 2]
    low = torch.bitwise_left_shift(p, 4) >> 4  # arithmetic shifts sign-extend the nibbles
    high = p >> 4
    return torch.stack((low, high), dim=-1).reshape(p.shape[0], out_features).t()


def _w4a8_dynamic(t: dict[str, torch.Tensor], name: str, shape: tuple[int, int], group_size: int) -> Dense:
    packed = need(t, f"{name}.weight")
    _check_shape(packed, (shape[0] // 2, shape[1]), f"{name}.weight")
    scale = need(t, f"{name}.weight_scale")
    _check_shape(scale, (shape[0], 1), f"{name}.weight_scale")
    q = unpack_int4_pairs(packed.reshape(shape[0] // 2, shape[1]), shape[0])
    # scale_bias is the kernel's correction for its unsigned INT4 trick: the product is the same
    return Dense(q.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1), "int4 channel",
                 "int8 token dynamic", quantize_input=PerTokenInt8())


def _w8a8_static(t: dict[str, torch.Tensor], name: str, shape: tuple[int, int], group_size: int) -> Dense:
    q = need(t, f"{name}.weight")
    deq = deq_scale_float32(need(t, f"{name}.deq_scale"))
    quant_bias = need(t, f"{name}.quant_bias")
    for key, tensor in ((f"{name}.deq_scale", deq), (f"{name}.quant_bias", quant_bias)):
        _check_shape(tensor, (shape[0],), key)
    codes = StaticInt8Codes(need(t, f"{name}.input_scale").reshape(()), need(t, f"{name}.input_offset").reshape(()))
    return Dense(q.to(torch.float32) * deq.reshape(-1, 1), "int8 channel", "int8 tensor static",
                 forward=StaticInt8Linear(codes, q, quant_bias, deq))


SCHEMES: dict[str, Callable[..., Dense]] = {"W8A8_DYNAMIC": _w8a8_dynamic, "W8A8": _w8a8_static,
                                            "W4A8_DYNAMIC": _w4a8_dynamic}
SCHEME_SUMMARY = {"W8A8_DYNAMIC": "int8 {weights} weights, int8 token dynamic inputs",
                  "W8A8": "int8 channel weights, int8 tensor static inputs with offset",
                  "W4A8_DYNAMIC": "int4 channel weights, int8 token dynamic inputs"}


# -- rotations ---------------------------------------------------------------------------------

# msModelSlim's QuaRot (processor "quarot", online: false) folds its rotations into the
# weights (R1 into the embedding, every reader and writer of the residual stream and the
# head; R2 into v/o per head; the norms' scales into the Linears, norms set to ones), so
# the saved checkpoint is an ordinary one; its R1 is saved beside it for the draft to fold
# (`specft fold-rotation --rotation CKPT`). Online rotations are saved as weights instead.
ONLINE_ROTATION_TENSORS = (".heads_rotation", ".kronecker_rotation_m", ".kronecker_rotation_n")


def offline_rotation(desc: dict) -> str | None:
    """The file holding the checkpoint's global rotation R1 (relative to the checkpoint),
    or None when it is not rotated; any other recorded rotation is refused."""
    optional = desc.get("optional") or {}
    unknown = sorted(k for k in optional if k != "quarot")
    if unknown:
        raise SpecftError(f"quant=checkpoint: this msModelSlim checkpoint carries optional.{unknown[0]}, which "
                          "specft cannot run yet (it runs offline QuaRot)")
    rotations = (optional.get("quarot") or {}).get("rotation_map") or {}
    extra = sorted(set(rotations) - {"global_rotation"})
    if extra:
        raise SpecftError(f"quant=checkpoint: this msModelSlim checkpoint's QuaRot records {extra[0]}, which "
                          "specft cannot run yet (it runs offline QuaRot: global_rotation only)")
    return rotations.get("global_rotation")


def _check_untied(model_dir: Path) -> None:
    """msModelSlim 26.1's QuaRot rotates a tied embedding twice, with the final norm's
    scale between (measured on SmolLM2: the saved embedding is ((E @ R1) * g) @ R1 to 4e-7),
    and keeps the tie: the model it writes is not the one it quantized."""
    if read_config(model_dir).get("tie_word_embeddings"):
        raise SpecftError(f"quant=checkpoint: {model_dir} was rotated by msModelSlim's QuaRot with tied embeddings, "
                          "which rotates the shared matrix twice; untie the model (tie_word_embeddings: false, "
                          "its own lm_head) before quantizing")


def rotation_file(model_dir: Path) -> str | None:
    """Where an msModelSlim checkpoint saved its R1 (relative to it), or None."""
    return offline_rotation(read_json(sorted(model_dir.glob(DESCRIPTION_GLOB))[0]))


def saved_rotation(model_dir: Path) -> torch.Tensor:
    """R1 as msModelSlim saved it (hidden states of the rotated model = original @ R1)."""
    where = rotation_file(model_dir)
    if where is None:
        raise SpecftError(f"--rotation: the msModelSlim checkpoint {model_dir} is not rotated "
                          "(no optional.quarot.rotation_map.global_rotation)")
    if not (model_dir / where).is_file():
        raise SpecftError(f"--rotation: {model_dir / where} (the checkpoint's saved QuaRot rotation) is missing")
    tensors = read_tensors(model_dir, where)
    if "global_rotation" not in tensors:
        raise SpecftError(f"--rotation: {model_dir / where} holds no global_rotation tensor")
    return tensors["global_rotation"]


# -- the family -----------------------------------------------------------------------------

class MsModelSlim(FormatFamily):
    name = "msmodelslim"
    description_files = (DESCRIPTION_GLOB,)

    def detect(self, model_dir: Path) -> bool:
        return any(model_dir.glob(DESCRIPTION_GLOB))

    def open(self, model_dir: Path) -> CheckpointQuant:
        desc = read_json(sorted(model_dir.glob(DESCRIPTION_GLOB))[0])
        schemes = {k[: -len(".weight")]: v for k, v in desc.items() if k.endswith(".weight") and v != "FLOAT"}
        unknown = sorted(set(schemes.values()) - set(SCHEMES))
        if unknown:
            raise SpecftError(f"quant=checkpoint: msModelSlim scheme {unknown[0]} is not supported yet; "
                              f"supported: {', '.join(SCHEMES)} (docs/checkpoints.md)")
        others = sorted(k for k, v in desc.items() if isinstance(v, str) and v.startswith("C8"))
        if desc.get("kv_quant_type") or desc.get("kv_cache_type") or others:
            raise SpecftError("quant=checkpoint: this msModelSlim checkpoint quantizes the KV cache, which specft "
                              "cannot run from a checkpoint yet")
        rotation = offline_rotation(desc)
        group_size = int(desc.get("group_size") or 0)
        weights = f"group {group_size}" if group_size else "channel"
        summary = "; ".join(f"{k}: {SCHEME_SUMMARY[k].format(weights=weights)}" for k in sorted(set(schemes.values())))
        if rotation:
            _check_untied(model_dir)
            summary += f"; QuaRot rotation folded offline (R1 saved at {rotation})"
        ckpt = CheckpointQuant(self.name, model_dir, summary)
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, schemes, group_size, model, dtype)
        return ckpt

    def _load_state(self, ckpt: CheckpointQuant, schemes: dict[str, str], group_size: int, model: nn.Module,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raw, schemes = read_tensors(ckpt.model_dir, "quant_model_weight*.safetensors"), dict(schemes)
        state = {k: v.to(dtype) for k, v in raw.items() if v.is_floating_point()
                 and k.rsplit(".", 1)[0] not in schemes}
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            scheme = schemes.pop(name, None)
            if scheme is None:  # kept in 16 bit ("FLOAT"), e.g. lm_head
                ckpt.ignored.append(name)
                continue
            dense = SCHEMES[scheme](raw, name, (module.out_features, module.in_features), group_size)
            _check_shape(dense.weight, tuple(module.weight.shape), f"{name}.weight")
            state[f"{name}.weight"] = dense.weight.reshape(module.weight.shape).to(dtype)
            ckpt.layers[name] = LayerQuant(name, dense.weight_desc, dense.input_desc, dense.quantize_input,
                                           dense.forward)
        online = sorted(k for k in raw if k.endswith(ONLINE_ROTATION_TENSORS))
        if online:
            raise SpecftError(f"quant=checkpoint: {online[0]} is an online rotation (msModelSlim QuaRot online), "
                              "which specft cannot run from a checkpoint yet; offline QuaRot runs")
        if schemes:  # quantized tensors the model has no Linear for
            raise SpecftError(f"model.path: {next(iter(schemes))} is quantized in the checkpoint, but the model "
                              "has no such linear layer")
        return state


CHECKPOINT_FORMATS.register("msmodelslim")(MsModelSlim())
