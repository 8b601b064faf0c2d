"""Fake quantization: quantize onto a format's grid and back, in the input's precision.

Schemes say where the scale comes from:
- ``tensor``: one fp32 scale, amax / max_value.
- ``channel`` / ``token``: one scale per row of the last dimension (a weight's output
  channel, an activation's token). Both reduce over the last (reduction) dimension.
- ``mx``: OCP MX 1.0 blocks of ``block_size`` along the last dimension, one E8M0
  (power-of-two) scale per block, computed by ``scale_rule``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specft.quant.formats import FloatFormat, get_format

SCHEMES = ("tensor", "channel", "token", "mx")
MX_SCALE_RULES = ("floor", "ceil")
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


@dataclass
class TensorQuantSpec:
    """How one kind of tensor (weights, activations) is quantized."""

    format: str = "e4m3"
    scheme: str = "channel"
    block_size: int = 32
    scale_rule: str = "floor"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _absmax_scale(x: torch.Tensor, max_value: float, dim: int | None) -> torch.Tensor:
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    amax = torch.nan_to_num(amax, nan=0.0, posinf=torch.finfo(x.dtype).max)
    scale = amax / max_value
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def mx_shared_exponent(amax: torch.Tensor, fmt: FloatFormat, rule: str) -> torch.Tensor:
    """E8M0 exponent per block. ``floor`` is the OCP rule: floor(log2 amax) - emax, which
    can clip the block's largest element; ``ceil`` picks the smallest power of two that
    keeps amax representable."""
    if rule == "floor":
        _, e = torch.frexp(amax)
        exp = e - 1 - fmt.emax
    elif rule == "ceil":
        exp = torch.ceil(torch.log2(amax / fmt.max_value)).to(torch.int32)
    else:
        raise ValueError(f"unknown MX scale rule {rule!r}; known: {', '.join(MX_SCALE_RULES)}")
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def _fake_quant_mx(x: torch.Tensor, spec: TensorQuantSpec) -> torch.Tensor:
    fmt = get_format(spec.format)
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"MX blocks need a float element format, got {spec.format!r}")
    n = x.shape[-1]
    pad = (-n) % spec.block_size
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    blocks = xp.reshape(*xp.shape[:-1], -1, spec.block_size)
    amax = torch.nan_to_num(blocks.abs().amax(dim=-1, keepdim=True), nan=0.0)
    scale = torch.exp2(mx_shared_exponent(amax, fmt, spec.scale_rule).to(x.dtype))
    scaled = blocks / scale
    q = (fmt.round(scaled) * scale).reshape(xp.shape)
    clipped = (scaled.abs() > fmt.clip_threshold).reshape(xp.shape)
    return (q[..., :n], clipped[..., :n]) if pad else (q, clipped)


def _fake_quant_absmax(x: torch.Tensor, spec: TensorQuantSpec):
    fmt = get_format(spec.format)
    scale = _absmax_scale(x, fmt.max_value, None if spec.scheme == "tensor" else -1)
    scaled = x / scale
    return fmt.round(scaled) * scale, scaled.abs() > fmt.clip_threshold


_SCHEME_FNS = {"tensor": _fake_quant_absmax, "channel": _fake_quant_absmax,
               "token": _fake_quant_absmax, "mx": _fake_quant_mx}


def quantize_with_clip_mask(x: torch.Tensor, spec: TensorQuantSpec):
    """(fake-quantized x in x's dtype, bool mask of elements clipped by saturation)."""
    try:
        fn = _SCHEME_FNS[spec.scheme]
    except KeyError:
        raise ValueError(f"unknown quant scheme {spec.scheme!r}; known: {', '.join(SCHEMES)}") from None
    q, clipped = fn(x.to(_compute_dtype(x)), spec)
    return q.to(x.dtype), clipped


def fake_quant(x: torch.Tensor, spec: TensorQuantSpec) -> torch.Tensor:
    """Quantize ``x`` per ``spec`` and dequantize, returning ``x``'s dtype (no gradient)."""
    return quantize_with_clip_mask(x, spec)[0]


class _StraightThrough(torch.autograd.Function):
    """Forward: fake quantization. Backward: identity inside the representable range,
    zero where the value was clipped (so QAT learns to stay in range)."""

    @staticmethod
    def forward(ctx, x, spec):
        q, clipped = quantize_with_clip_mask(x, spec)
        ctx.save_for_backward(clipped)
        return q

    @staticmethod
    def backward(ctx, grad):
        (clipped,) = ctx.saved_tensors
        return grad.masked_fill(clipped, 0.0), None


def fake_quant_ste(x: torch.Tensor, spec: TensorQuantSpec) -> torch.Tensor:
    return _StraightThrough.apply(x, spec)
