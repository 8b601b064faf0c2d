"""Fake quantization: quantize onto a format's grid and back, in the input's precision.

Schemes (``SCHEMES``: Scheme objects) say where scales come from. All reduce along the last
dimension, which is the reduction (input) dimension of a Linear weight [out, in] and of
an activation [..., in]:

- ``tensor``: one fp32 scale for the whole tensor.
- ``channel`` / ``token``: one scale per row (a weight's output channel, a token).
- ``group``: one scale per 1 x ``block_size`` group along the last dim (INT4 g128).
- ``block``: one scale per ``block_size`` x ``block_size`` tile of the last two dims
  (DeepSeek-V3 style 128 x 128 weight blocks).
- ``mx``: OCP MX 1.0, ``block_size`` (32) elements share an E8M0 power-of-two scale,
  chosen by ``scale_rule`` (see ``mx_shared_exponent``).
- ``nvfp4``: 16-element blocks with an E4M3 block scale times an fp32 tensor scale.

Integer formats may be asymmetric (``symmetric: false``): a scale and an integer zero
point per scale group, values on [0, 2**bits - 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specft.quant.formats import ELEMENT_FORMATS, FloatFormat, IntFormat, get_format

MX_SCALE_RULES = ("floor", "even", "ceil", "rceil")
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


@dataclass
class TensorQuantSpec:
    """How one kind of tensor (weights, activations, KV cache) is quantized."""

    format: str = "e4m3"
    scheme: str = "channel"
    block_size: int = 32  # group: G; block: B (B x B); mx: 32; nvfp4: 16
    scale_rule: str = "floor"  # mx only
    symmetric: bool = True  # integer formats only
    dynamic: bool = True  # activations: false = a static per-tensor scale, calibrated


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _finite_amax(x: torch.Tensor, dims) -> torch.Tensor:
    amax = x.abs().amax(dim=dims, keepdim=True)
    return torch.nan_to_num(amax, nan=0.0, posinf=torch.finfo(x.dtype).max)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# -- grouping: view x so that each scale group is reduced over `dims` -------------------

def _pad_last(x: torch.Tensor, multiple: int, dim: int = -1) -> torch.Tensor:
    pad = (-x.shape[dim]) % multiple
    if not pad:
        return x
    widths = [0, 0] * (-dim - 1) + [0, pad]
    return F.pad(x, widths)


def _whole(x: torch.Tensor, spec: TensorQuantSpec):
    return x, tuple(range(x.dim())), lambda y: y


def _rows(x: torch.Tensor, spec: TensorQuantSpec):
    return x, (-1,), lambda y: y


def _groups_along_last(x: torch.Tensor, spec: TensorQuantSpec):
    shape = x.shape
    xp = _pad_last(x, spec.block_size)
    v = xp.reshape(*xp.shape[:-1], -1, spec.block_size)
    return v, (-1,), lambda y: y.reshape(xp.shape)[..., : shape[-1]]


def _tiles(x: torch.Tensor, spec: TensorQuantSpec):
    if x.dim() < 2:
        raise ValueError("block scaling needs a tensor with at least 2 dims")
    shape, b = x.shape, spec.block_size
    xp = _pad_last(_pad_last(x, b, -1), b, -2)
    r, c = xp.shape[-2:]
    v = xp.reshape(*xp.shape[:-2], r // b, b, c // b, b)
    return v, (-3, -1), lambda y: y.reshape(xp.shape)[..., : shape[-2], : shape[-1]]


def _grouped(x: torch.Tensor, spec: TensorQuantSpec):
    """(view of x with scale groups, dims to reduce, fn mapping the view back to x)."""
    if spec.scheme not in SCHEMES:
        raise ValueError(f"unknown quant scheme {spec.scheme!r}; known: {', '.join(SCHEMES)}")
    return SCHEMES[spec.scheme].group(x, spec)


# -- scale computation -------------------------------------------------------------------

def mx_shared_exponent(amax: torch.Tensor, fmt: FloatFormat, rule: str) -> torch.Tensor:
    """E8M0 exponent per block from the block's amax:

    - ``floor`` (OCP MX 1.0, Ascend scaleAlg=0): floor(log2 amax) - emax. Cheap, but a
      block whose amax mantissa exceeds the element format's max mantissa (1.5 for
      E2M1) has its largest elements clipped.
    - ``even``: amax first rounded to the element's mantissa width (half up), then the
      floor rule, so amax never clips by more than rounding would.
    - ``ceil``: ceil(log2 amax) - emax (a power of two amax keeps the floor result).
    - ``rceil``: amax / max_value rounded up to a power of two (cuBLAS / Blackwell
      cvt.rp): the smallest scale at which no element clips.
    """
    if rule == "floor":
        _, e = torch.frexp(amax)
        exp = e - 1 - fmt.emax
    elif rule == "even":
        m, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
        step = 2.0 ** -(fmt.mbits + 1)
        rounded = torch.floor(m / step + 0.5) * step  # may reach 1.0: next binade
        exp = e - 1 - fmt.emax + (rounded >= 1.0).to(e.dtype)
    elif rule == "ceil":
        m, e = torch.frexp(amax)
        exp = e - 1 - fmt.emax + (m > 0.5).to(e.dtype)
    elif rule == "rceil":
        m, e = torch.frexp(amax / fmt.max_value)
        exp = e - 1 + (m > 0.5).to(e.dtype)
    else:
        raise ValueError(f"unknown MX scale rule {rule!r}; known: {', '.join(MX_SCALE_RULES)}")
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def _absmax_scale(v, dims, spec, fmt, x_full):
    return _nonzero(_finite_amax(v, dims) / fmt.max_value)


def _mx_scale(v, dims, spec, fmt, x_full):
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"MX blocks need a float element format, got {spec.format!r}")
    amax = _finite_amax(v, dims)
    return torch.exp2(mx_shared_exponent(amax, fmt, spec.scale_rule).to(v.dtype))


NVFP4_BLOCK_SCALE = ELEMENT_FORMATS["e4m3"]


def _nvfp4_scale(v, dims, spec, fmt, x_full):
    """Block scale amax_b / 6 stored in E4M3 relative to a tensor scale that maps the
    tensor's amax onto E4M3's range: s_t = amax_t / (448 * 6)."""
    tensor_scale = _nonzero(_finite_amax(x_full, tuple(range(x_full.dim()))) /
                            (NVFP4_BLOCK_SCALE.max_value * fmt.max_value))
    block = NVFP4_BLOCK_SCALE.round(_finite_amax(v, dims) / fmt.max_value / tensor_scale)
    return _nonzero(block) * tensor_scale  # an all-zero block quantizes to 0 anyway


@dataclass(frozen=True)
class Scheme:
    """Where a tensor's scales come from, and the facts the rest of specft reads about it
    (validation, `specft plan`'s bytes, `specft info`): a new scheme is one entry here."""

    group: Callable  # (x, spec) -> (grouped view, dims each scale reduces, view -> x)
    scale: Callable  # (view, dims, spec, element format, whole x) -> scales
    scale_bits: int  # bits stored per scale
    elements_per_scale: Callable[[TensorQuantSpec, float], float]  # (spec, a weight's in_features)
    blocked: bool = False  # block_size is one of its parameters
    whole_blocks: bool = False  # hardware blocks along the reduction dim: block_size divides the model's
    roles: tuple[str, ...] = ("weight", "activation")  # which tensors it may scale
    roles_note: str | None = None  # the error's advice when used for another role
    formats: tuple[str, ...] | None = None  # element formats it takes (None: any)
    formats_note: str | None = None  # the error's text when given another format
    static: bool = False  # a calibrated (dynamic: false) scale is possible


def _block(spec: TensorQuantSpec, in_features: float) -> float:
    return spec.block_size


SCHEMES: dict[str, Scheme] = {
    "tensor": Scheme(_whole, _absmax_scale, 0, lambda spec, n: float("inf"), static=True,
                     roles=("weight", "activation", "kv")),
    "channel": Scheme(_rows, _absmax_scale, 32, lambda spec, n: n),
    # Per-token scales travel with the activation (or KV entry): no stored weight bytes.
    "token": Scheme(_rows, _absmax_scale, 0, lambda spec, n: float("inf"), roles=("weight", "activation", "kv")),
    "group": Scheme(_groups_along_last, _absmax_scale, 16, _block, blocked=True),
    "block": Scheme(_tiles, _absmax_scale, 32, lambda spec, n: spec.block_size ** 2, blocked=True,
                    roles=("weight",), roles_note="block (B x B) scales are for weights; use group for activations"),
    "mx": Scheme(_groups_along_last, _mx_scale, 8, _block, blocked=True, whole_blocks=True,
                 formats=("e4m3", "e5m2", "e2m1"), formats_note="MX blocks need e4m3, e5m2 or e2m1"),
    "nvfp4": Scheme(_groups_along_last, _nvfp4_scale, 8, _block, blocked=True, whole_blocks=True,
                    formats=("e2m1",), formats_note="nvfp4 uses e2m1 elements"),
}
ROWWISE_SCHEMES = ("token", "channel")  # one scale per row: the float32 fast path
# Inputs the fast path takes, computing in float32 as the general path does (bfloat16 is
# what a target in model.dtype=auto runs in on a CPU with native bf16).
ROWWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)



# -- quantization --------------------------------------------------------------------------

def _quantize_symmetric(v, scale, fmt, want_mask: bool = True):
    scaled = v / scale
    clipped = scaled.abs() > fmt.clip_threshold if want_mask else None
    return fmt.round(scaled) * scale, clipped


# Rows fake-quantized together on the fast path: ~1 MB of float32. A prefill's linear
# inputs (thousands of tokens x 1,536) made every temporary tens of MB: each one a fresh
# mapping that page-faults on every touch, out of cache. Measured 4x faster in pieces.
ROWWISE_CHUNK_ELEMENTS = 1 << 18


def _rowwise_float32(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Per-row (token / channel) fake quantization of a float32 tensor onto a float grid:
    the same operations as the general path (amax, the scale, divide, round, rescale)
    with no clip mask and no extra copies. This is every linear input of an
    FP8-activation target at every decode step, and of every prefill, in pieces of
    rows: each row is quantized on its own, so the pieces give the same numbers."""
    if x.numel() <= 2 * ROWWISE_CHUNK_ELEMENTS or x.dim() < 2:
        return _rowwise_piece(x, fmt)
    rows = max(1, ROWWISE_CHUNK_ELEMENTS // x.shape[-1])
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    for start in range(0, flat.shape[0], rows):
        out[start: start + rows] = _rowwise_piece(flat[start: start + rows], fmt)
    return out.view(x.shape)


def _rowwise_piece(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    scale = _absmax_scale(x, (-1,), None, fmt, x)
    return fmt.round_float32(torch.div(x, scale)).mul_(scale)


def _quantize_asymmetric(v, dims, fmt: IntFormat):
    lo = torch.nan_to_num(v.amin(dim=dims, keepdim=True)).clamp(max=0)
    hi = torch.nan_to_num(v.amax(dim=dims, keepdim=True)).clamp(min=0)
    scale = _nonzero((hi - lo) / fmt.levels)
    zero_point = torch.round(-lo / scale)
    q = (torch.round(v / scale) + zero_point).clamp(0, fmt.levels)
    return (q - zero_point) * scale, torch.zeros_like(v, dtype=torch.bool)


def quantize_with_clip_mask(x: torch.Tensor, spec: TensorQuantSpec,
                            scale: torch.Tensor | None = None):
    """(fake-quantized x in x's dtype, bool mask of elements clipped by saturation).
    ``scale`` overrides the computed scale (static, calibrated activation scales)."""
    return _quantize(x, spec, scale, want_mask=True)


def _quantize(x: torch.Tensor, spec: TensorQuantSpec, scale: torch.Tensor | None, want_mask: bool):
    fmt = get_format(spec.format)
    if (not want_mask and scale is None and x.dtype in ROWWISE_DTYPES and spec.scheme in ROWWISE_SCHEMES
            and isinstance(fmt, FloatFormat)):
        return _rowwise_float32(x.float(), fmt).to(x.dtype), None  # .float()/.to: no-ops for float32
    xc = x.to(_compute_dtype(x))
    if scale is not None:
        q, clipped = _quantize_symmetric(xc, scale.to(xc.dtype), fmt, want_mask)
        return q.to(x.dtype), clipped
    v, dims, back = _grouped(xc, spec)
    if isinstance(fmt, IntFormat) and not spec.symmetric:
        q, clipped = _quantize_asymmetric(v, dims, fmt)
    else:
        q, clipped = _quantize_symmetric(v, SCHEMES[spec.scheme].scale(v, dims, spec, fmt, xc), fmt, want_mask)
    return back(q).to(x.dtype), back(clipped) if clipped is not None else None


def quantized_parts(x: torch.Tensor, spec: TensorQuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """What a serving format stores for symmetric schemes: (elements in the element
    format's own units, grouped as the scheme groups them; scales, broadcastable to the
    elements). elements * scales == fake_quant(x, spec), on the grouped view."""
    fmt = get_format(spec.format)
    xc = x.to(_compute_dtype(x))
    v, dims, _ = _grouped(xc, spec)
    scale = SCHEMES[spec.scheme].scale(v, dims, spec, fmt, xc)
    return fmt.round(v / scale), scale


def fake_quant(x: torch.Tensor, spec: TensorQuantSpec, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` per ``spec`` and dequantize, returning ``x``'s dtype (no gradient)."""
    return _quantize(x, spec, scale, want_mask=False)[0]


class _StraightThrough(torch.autograd.Function):
    """Forward: fake quantization. Backward: identity inside the representable range,
    zero where a static scale clipped the value (so QAT learns to stay in range).

    With dynamic scales the range follows the tensor, so nothing is out of range: the
    elements the MX floor rule saturates are the block maxima that set the scale, and
    cutting their gradient stops a block from ever growing (a QAT toy then stalls at
    ~25% of its initial loss instead of ~4%). Their gradient passes."""

    @staticmethod
    def forward(ctx, x, spec, scale):
        q, clipped = quantize_with_clip_mask(x, spec, scale)
        if scale is None:
            clipped = torch.zeros_like(clipped)
        ctx.save_for_backward(clipped)
        return q

    @staticmethod
    def backward(ctx, grad):
        (clipped,) = ctx.saved_tensors
        return grad.masked_fill(clipped, 0.0), None, None


def fake_quant_ste(x: torch.Tensor, spec: TensorQuantSpec, scale: torch.Tensor | None = None) -> torch.Tensor:
    return _StraightThrough.apply(x, spec, scale)


def static_scale(amax: torch.Tensor, spec: TensorQuantSpec) -> torch.Tensor:
    """The fixed per-tensor scale for a calibrated amax."""
    return _nonzero(amax / get_format(spec.format).max_value)
