"""compressed-tensors checkpoints (llm-compressor's output; also what msModelSlim and
ModelOpt can export to): ``quantization_config.quant_method == "compressed-tensors"``.

Supported here: the formats ``float-quantized`` (FP8 weights per tensor, channel or
block), ``int-quantized`` and ``naive-quantized`` (INT8 weights), ``pack-quantized``
(INT1-8 weights packed into int32, per channel or group, with packed zero points),
``nvfp4-pack-quantized`` (FP4 E2M1 weights in groups of 16, FP8 group scales under a
global scale) and ``mxfp4-pack-quantized`` (FP4 weights in groups of 32, E8M0
power-of-two scales), with 16-bit, dynamic or static symmetric activations per tensor,
token or group (FP4 inputs: NVFP4's dynamic group scales under a calibrated global one,
MX's dynamic power-of-two group scales).

The arithmetic is the format's own (compressed_tensors/quantization/lifecycle), written
out here so that specft needs no compressed-tensors at run time, and checked bit for bit
against that library in tests/test_quantized_checkpoints.py:

- weights: ``(q - zero_point) * scale`` in the scale's dtype, the scale broadcast over
  its channel, group or block, then cast to the model's dtype;
- a symmetric scale is ``amax / (range / 2)`` (INT8: /127.5, not /127; FP8: /448; FP4:
  /6), a zero scale becomes the dtype's eps, values are ``x / scale`` clamped to the range
  and rounded (INT: half to even; FP8: a cast to float8_e4m3fn; FP4: nearest E2M1 value,
  ties to even, which is specft's e2m1 rounding), all in the activation's dtype;
- NVFP4 group scales are taken times the global scale, rounded to FP8 (a zero one
  becomes 0.125) and divided by it again, in float32; MX group scales are 2**e with e
  from the group's amax rounded to the element's mantissa width (specft's "even" MX rule);
- dynamic "token" scales reduce every dim but the first two (a [B, T, H] input: per
  token), as the library does.

Transforms (``transform_config``: llm-compressor's SpinQuant and QuIP rotations): those at
``weight_input`` / ``weight_output`` are already fused into the saved weights; those at
``input`` run here as the library runs them, before the input quantizer: the module's
saved ``<group>_input.weight`` W (its transpose when ``inverse``), x -> (x @ W) / sqrt(n)
in W's precision (float64) and back, block-diagonal when W is narrower than the input
(compressed_tensors/transform/factory/hadamard.py). Those at ``q_attn`` / ``k_cache``
(SpinQuant's R3) rotate every head's queries / keys after RoPE the same way, on every
attention call; the library ties one matrix across layers, and so does specft. Outputs
and randomized or matrix transforms are refused with one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specft.common.errors import SpecftError
from specft.quant.fake_quant import mx_shared_exponent
from specft.quant.formats import get_format
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    LayerQuant,
    QuantMethodFamily,
    need,
    read_tensors,
)

QUANT_METHOD = "compressed-tensors"
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
WEIGHT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized", *FP4_FORMATS)
FP8_MAX = 448.0  # float8_e4m3fn
FLOAT_ELEMENTS = {8: get_format("e4m3"), 4: get_format("e2m1")}
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # a code's low three bits
# Tensors a quantized Linear stores beside (or instead of) its weight.
QUANT_TENSORS = ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_g_idx",
                 "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale")


@dataclass
class CTArgs:
    """One tensor's quantization args as the config writes them."""

    num_bits: int
    type: str  # int | float
    symmetric: bool
    strategy: str  # tensor | channel | group | block | token
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    dynamic: bool = False
    scale_dtype: str | None = None  # e.g. "torch.uint8": MX's E8M0 exponents

    @classmethod
    def parse(cls, raw: dict, where: str) -> CTArgs:
        args = cls(num_bits=int(raw.get("num_bits", 8)), type=raw.get("type", "int"),
                   symmetric=bool(raw.get("symmetric", True)), strategy=raw.get("strategy", "tensor"),
                   group_size=raw.get("group_size"),
                   block_structure=tuple(raw["block_structure"]) if raw.get("block_structure") else None,
                   dynamic=raw.get("dynamic") in (True, "local"), scale_dtype=raw.get("scale_dtype"))
        supported = {("int", n) for n in range(1, 9)} | {("float", 8), ("float", 4)}
        if (args.type, args.num_bits) not in supported:
            raise SpecftError(f"quant=checkpoint: {where} is {args.type}{args.num_bits}, which specft cannot run "
                              "yet; supported: int1-8, float8 (e4m3) and float4 (e2m1)")
        return args

    @property
    def is_mx(self) -> bool:
        """OCP MX: float elements in groups of 32 under E8M0 (uint8) exponents."""
        return self.type == "float" and self.group_size == 32 and str(self.scale_dtype).endswith("uint8")

    @property
    def element(self):
        """specft's element format for float codes (None for int)."""
        return FLOAT_ELEMENTS[self.num_bits] if self.type == "float" else None

    @property
    def q_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The library's (q_min, q_max), float32 scalars."""
        if self.type == "float":
            return torch.tensor(-self.element.max_value), torch.tensor(self.element.max_value)
        half = 2.0 ** self.num_bits / 2
        return torch.tensor(-half), torch.tensor(half - 1)

    def describe(self) -> str:
        kind = ("mx" if self.is_mx else "") + (f"fp{self.num_bits}" if self.type == "float" else f"int{self.num_bits}")
        shape = {"group": f"group {self.group_size}", "tensor_group": f"group {self.group_size} (+ global scale)",
                 "block": f"block {'x'.join(map(str, self.block_structure or ()))}"}.get(self.strategy, self.strategy)
        return f"{kind} {shape}" + ("" if self.symmetric else " asymmetric") + (" dynamic" if self.dynamic else "")


def round_to_grid(x: torch.Tensor, args: CTArgs) -> torch.Tensor:
    """Clamp to the range, round onto the grid, back in x's dtype."""
    lo, hi = args.q_range
    x = torch.clamp(x, lo, hi)
    if args.type == "float" and args.num_bits == 4:
        return args.element.round(x)
    rounded = x.to(torch.float8_e4m3fn) if args.type == "float" else torch.round(x)
    return rounded.to(x.dtype)


# -- weights ------------------------------------------------------------------------------

def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """The library's dense packing: element i of a row is bits [i*b, (i+1)*b) of the row's
    int32 words read as one little-endian bit string, stored with an offset of
    2**(b-1). Returns int8 values [rows, count]."""
    words = packed.contiguous().numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8).reshape(words.shape[0], -1), axis=1, bitorder="little")
    bits = bits[:, : count * num_bits].reshape(words.shape[0], count, num_bits).astype(np.int32)
    values = (bits << np.arange(num_bits, dtype=np.int32)).sum(-1) - (1 << (num_bits - 1))
    return torch.from_numpy(values.astype(np.int8))


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte, the low nibble first; bit 3 of a code is its sign.
    Returns bfloat16 [rows, 2 * bytes], as the library's unpacking does."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    values = E2M1_VALUES[(codes & 0x07).long()] * torch.where((codes & 0x08).bool(), -1.0, 1.0)
    return values.to(torch.bfloat16)


def expected_scale_shape(args: CTArgs, out: int, inp: int) -> tuple[int, ...]:
    if args.strategy == "channel":
        return (out, 1)
    if args.strategy in ("group", "tensor_group"):
        return (out, -(-inp // args.group_size))
    if args.strategy == "block":
        b0, b1 = args.block_structure
        return (-(-out // b0), -(-inp // b1))
    return (1,)


def broadcast_scale(t: torch.Tensor, args: CTArgs, shape: tuple[int, int]) -> torch.Tensor:
    """A per-group/block parameter repeated to the weight's shape (channel and tensor
    parameters broadcast as they are)."""
    if args.strategy in ("group", "tensor_group"):
        return t.repeat_interleave(args.group_size, dim=1)[:, : shape[1]]
    if args.strategy == "block":
        b0, b1 = args.block_structure
        return t.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)[: shape[0], : shape[1]]
    return t.reshape(-1, 1) if args.strategy == "channel" else t.reshape(())


def dequantize_weight(tensors: dict[str, torch.Tensor], args: CTArgs, fmt: str, name: str) -> torch.Tensor:
    """The dense weight of one layer, in its scale's dtype (FP4: bfloat16)."""
    if fmt in FP4_FORMATS:
        return _dequantize_fp4(tensors, args, fmt, name)
    scale = need(tensors, "weight_scale", name)
    if fmt == "pack-quantized":
        shape = tuple(int(v) for v in need(tensors, "weight_shape", name).tolist())
        q = unpack_int32(need(tensors, "weight_packed", name), args.num_bits, shape[1])
    else:
        q = need(tensors, "weight", name)
        shape = tuple(q.shape)
    _check_scale_shape(scale, args, shape, name)
    zero = tensors.get("weight_zero_point")
    if zero is not None and fmt == "pack-quantized":  # packed along the output dim
        zero = unpack_int32(zero.t(), args.num_bits, shape[0]).t()
    if zero is None and not args.symmetric:
        raise SpecftError(f"model.path: {name}.weight_zero_point is missing: {args.describe()} weights need it")
    if zero is not None and tuple(zero.shape) != tuple(scale.shape):
        raise SpecftError(f"model.path: {name}.weight_zero_point has shape {list(zero.shape)}, its scales "
                          f"{list(scale.shape)}")
    dq = q.to(scale.dtype)
    if zero is not None:
        dq = dq - broadcast_scale(zero.to(scale.dtype), args, shape)
    return dq * broadcast_scale(scale, args, shape)


def _dequantize_fp4(tensors: dict[str, torch.Tensor], args: CTArgs, fmt: str, name: str) -> torch.Tensor:
    q = unpack_fp4(need(tensors, "weight_packed", name))
    scale = need(tensors, "weight_scale", name)
    _check_scale_shape(scale, args, tuple(q.shape), name)
    if fmt == "mxfp4-pack-quantized":  # E8M0: 2**(e - 127), in bfloat16 as the library decodes it
        scale = 2.0 ** (scale.to(torch.int32) - 127).to(torch.bfloat16)
    else:  # FP8 group scales relative to the tensor's global scale (float32: the product is float32)
        scale = scale.to(q.dtype) / need(tensors, "weight_global_scale", name)
    return (q.to(scale.dtype) * broadcast_scale(scale, args, tuple(q.shape))).to(q.dtype)


def _check_scale_shape(scale: torch.Tensor, args: CTArgs, shape: tuple[int, int], name: str) -> None:
    want = expected_scale_shape(args, *shape)
    if tuple(scale.shape) != want and not (want == (1,) and scale.numel() == 1):
        raise SpecftError(f"model.path: {name}.weight_scale has shape {list(scale.shape)}, but {args.describe()} "
                          f"scales of a {list(shape)} weight have {list(want)}")


# -- activations --------------------------------------------------------------------------

class InputQuantizer:
    """A Linear's input as the checkpoint quantizes it at run time (dynamic: scales from
    each input; static: the checkpoint's ``input_scale``; NVFP4: dynamic group scales
    under the checkpoint's ``input_global_scale``)."""

    def __init__(self, args: CTArgs, scale: torch.Tensor | None = None, global_scale: torch.Tensor | None = None):
        self.args, self.scale, self.global_scale = args, scale, global_scale

    @property
    def share_key(self):
        """q/k/v (and gate/up) read one tensor: dynamic scales from it are the same for
        each, so SharedInput quantizes it once; static scales are per layer."""
        if not self.args.dynamic:
            return None
        glob = None if self.global_scale is None else float(self.global_scale.reshape(-1)[0])
        return ("compressed-tensors", *vars(self.args).values(), glob)

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        if a.strategy in ("group", "tensor_group"):
            x = x.unflatten(-1, (-(-x.shape[-1] // a.group_size), a.group_size))
            lo, hi = torch.amin(x, dim=-1), torch.amax(x, dim=-1)
        elif a.strategy == "token" and x.dim() > 2:
            dims = tuple(range(2, x.dim()))
            lo, hi = torch.amin(x, dim=dims, keepdim=True), torch.amax(x, dim=dims, keepdim=True)
        else:  # tensor (and "token" on a 2-D input: the library then reduces everything)
            lo, hi = torch.aminmax(x)
        zero = torch.zeros_like(lo)
        return torch.max(torch.min(lo, zero).abs(), torch.max(hi, zero).abs())

    def qparams(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        if not a.dynamic:
            return self.scale.to(x.dtype)
        amax = self._amax(x)
        if a.is_mx:  # E8M0: never zero, so no eps
            exp = mx_shared_exponent(amax, a.element, "even")
            return (2.0 ** exp.to(torch.float32)).to(amax.dtype)
        q_lo, q_hi = a.q_range
        scale = amax / ((q_hi - q_lo).to(amax.dtype) / 2)
        if self.global_scale is not None:  # NVFP4: FP8 group scales relative to the global one
            scale = (self.global_scale * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
            return torch.where(scale == 0, torch.tensor(0.125), scale) / self.global_scale
        eps = torch.finfo(scale.dtype).eps
        return torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype), scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.qparams(x)
        if self.args.strategy in ("group", "tensor_group"):
            g = x.unflatten(-1, (-1, self.args.group_size))
            s = scale.unsqueeze(-1)
            return (round_to_grid(g / s, self.args).to(s.dtype) * s).flatten(-2).reshape(x.shape).to(x.dtype)
        return round_to_grid(x / scale, self.args).to(scale.dtype) * scale


def input_quantizer(args: CTArgs, local: dict[str, torch.Tensor], name: str) -> InputQuantizer:
    if args.strategy == "tensor_group":  # NVFP4: a calibrated global scale over dynamic group scales
        return InputQuantizer(args, global_scale=need(local, "input_global_scale", name))
    return InputQuantizer(args, None if args.dynamic else need(local, "input_scale", name))


# -- transforms left for run time -------------------------------------------------------------

FUSED_LOCATIONS = ("weight_input", "weight_output")  # folded into the saved weights
ONLINE_KINDS = ("hadamard", "random-hadamard")  # saved unnormalized; applied / sqrt(n)
# a Linear's input; queries after RoPE; keys after RoPE, as the KV cache stores them
ONLINE_LOCATIONS = ("input", "q_attn", "k_cache")


@dataclass
class OnlineTransform:
    """One ``apply`` entry of a transform group that runs at a module's input."""

    group: str
    kind: str
    location: str  # one of ONLINE_LOCATIONS
    targets: list[str]
    ignore: list[str]
    inverse: bool
    head_dim: int | None  # block size; None: the module's input width

    @property
    def tensor(self) -> str:
        return f"{self.group}_{self.location}.weight"  # the library's submodule name: <group>_<location>


def online_transforms(tcfg: dict) -> list[OnlineTransform]:
    out = []
    for gname, scheme in (tcfg.get("config_groups") or {}).items():
        kind = scheme.get("type")
        for args in scheme.get("apply") or []:
            where = args.get("location")
            if where in FUSED_LOCATIONS:
                continue
            if where not in ONLINE_LOCATIONS or kind not in ONLINE_KINDS or scheme.get("randomize"):
                raise SpecftError(f"quant=checkpoint: transform {gname} runs at {where} ({kind}"
                                  f"{', randomized' if scheme.get('randomize') else ''}), which specft cannot run "
                                  f"yet; supported at run time: rotations of kind {' or '.join(ONLINE_KINDS)} at "
                                  f"{', '.join(ONLINE_LOCATIONS)}")
            out.append(OnlineTransform(gname, kind, where, list(args.get("targets") or []),
                                       list(args.get("ignore") or []), bool(args.get("inverse")),
                                       scheme.get("head_dim")))
    return out


class RotatedInput:
    """A Linear's input rotated as the checkpoint's transform says, then quantized (when
    it is): never shared between layers (share_key None), since each holds its own matrix."""

    share_key = None

    def __init__(self, matrix: torch.Tensor, quantize=None):
        self.matrix, self.quantize = matrix, quantize
        self.scale = math.sqrt(matrix.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.matrix.shape[0]
        y = ((x.to(self.matrix.dtype).unflatten(-1, (-1, n)) @ self.matrix).flatten(-2) / self.scale).to(x.dtype)
        return self.quantize(y) if self.quantize is not None else y


@dataclass
class AttentionRotation:
    """Queries and/or keys (after RoPE) rotated per head at every attention call, as a
    Linear's input is (RotatedInput); one matrix for all layers (the library ties them)."""

    query: RotatedInput | None
    key: RotatedInput | None
    description: str

    def __call__(self, query, key, value):
        return (self.query(query) if self.query else query), (self.key(key) if self.key else key), value


def _transform_matrix(raw: dict, t: OnlineTransform, name: str, module: nn.Module) -> torch.Tensor:
    """The module's own saved matrix, or the group's one of its size: the library shares one
    matrix per size across modules and locations (tied weights; R3's keys use its queries'),
    and saving keeps it under one name."""
    if f"{name}.{t.tensor}" in raw:
        matrix = raw[f"{name}.{t.tensor}"]
    else:
        size = t.head_dim or module.in_features
        same_place = [v for k, v in raw.items() if k.endswith("." + t.tensor) and v.shape == (size, size)]
        same_group = [v for k, v in raw.items() if k.endswith(".weight") and "." in k and
                      k.rsplit(".", 2)[-2].startswith(t.group + "_") and v.shape == (size, size)]
        matrix = (same_place or same_group or [need(raw, f"{name}.{t.tensor}")])[0]
    return matrix.T if t.inverse else matrix


def _targets(t: OnlineTransform, model: nn.Module):
    for name, module in model.named_modules():
        if any(_matches(p, name, module) for p in t.targets) and not any(_matches(p, name, module) for p in t.ignore):
            yield name, module


def _rotate_attention(ckpt: CheckpointQuant, transforms: list[OnlineTransform], model: nn.Module,
                      raw: dict) -> None:
    """Queries and keys rotated as the checkpoint's q_attn / k_cache transforms say, on
    every decoder layer's attention with one matrix each (as SpinQuant's R3 saves them)."""
    rotations, parts = {}, {}
    for t in (t for t in transforms if t.location in ("q_attn", "k_cache")):
        found = [_transform_matrix(raw, t, name, module) for name, module in _targets(t, model)]
        layers = model.config.num_hidden_layers
        if len(found) != layers or any(not torch.equal(m, found[0]) for m in found):
            raise SpecftError(f"quant=checkpoint: transform {t.group} at {t.location} covers {len(found)} of "
                              f"{layers} attention layers or differs between them; specft runs one matrix for all")
        rotations[t.location] = RotatedInput(found[0])
        parts[t.location] = f"{'queries' if t.location == 'q_attn' else 'keys'} by {t.group} ({found[0].shape[0]} wide)"
    if rotations:
        ckpt.attention.append(AttentionRotation(rotations.get("q_attn"), rotations.get("k_cache"),
                                                " and ".join(parts[w] for w in ("q_attn", "k_cache") if w in parts)
                                                + ", after RoPE, per head"))


def _rotate_inputs(ckpt: CheckpointQuant, transforms: list[OnlineTransform], model: nn.Module, raw: dict) -> None:
    """Put each online transform at a Linear's input in front of its input quantizer."""
    for t in (t for t in transforms if t.location == "input"):
        for name, module in _targets(t, model):
            matrix = _transform_matrix(raw, t, name, module)
            layer = ckpt.layers.get(name) or LayerQuant(name, "16-bit", None)
            layer.quantize_input = RotatedInput(matrix, layer.quantize_input)
            layer.activation = f"{t.group} {t.kind} rotation, then {layer.activation or '16-bit'}"
            ckpt.layers[name] = layer


# -- the family -----------------------------------------------------------------------------

@dataclass
class ConfigGroup:
    name: str
    targets: list[str]
    weights: CTArgs | None
    inputs: CTArgs | None
    fmt: str


def _matches(pattern: str, name: str, module: nn.Module) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in (name, type(module).__name__)


def _groups(qcfg: dict) -> list[ConfigGroup]:
    top_fmt = qcfg.get("format", "dense")
    groups = []
    for gname, raw in (qcfg.get("config_groups") or {}).items():
        fmt = raw.get("format") or top_fmt
        if fmt not in WEIGHT_FORMATS:
            raise SpecftError(f"quant=checkpoint: compressed-tensors format {fmt!r} ({gname}) is not supported yet; "
                              f"supported: {', '.join(WEIGHT_FORMATS)} (docs/checkpoints.md)")
        weights = CTArgs.parse(raw["weights"], f"{gname}.weights") if raw.get("weights") else None
        inputs = CTArgs.parse(raw["input_activations"], f"{gname}.input_activations") \
            if raw.get("input_activations") else None
        if inputs is not None and not inputs.symmetric:
            raise SpecftError(f"quant=checkpoint: {gname} quantizes activations with a zero point, which specft "
                              "cannot run yet; supported: symmetric activations")
        if raw.get("output_activations"):
            raise SpecftError(f"quant=checkpoint: {gname} quantizes output activations, which specft cannot run yet")
        groups.append(ConfigGroup(gname, list(raw.get("targets") or []), weights, inputs, fmt))
    return groups


class CompressedTensors(QuantMethodFamily):
    name, method = "compressed-tensors", QUANT_METHOD
    packs = True

    def open(self, model_dir: Path) -> CheckpointQuant:
        qcfg = self.quantization_config(model_dir)
        if qcfg.get("kv_cache_scheme"):
            raise SpecftError("quant=checkpoint: this compressed-tensors checkpoint quantizes the KV cache, which "
                              "specft cannot run from a checkpoint yet")
        transforms = online_transforms(qcfg.get("transform_config") or {})
        groups = _groups(qcfg)
        ignore = list(qcfg.get("ignore") or [])
        summary = "; ".join(f"{g.fmt}: {g.weights.describe() if g.weights else '16-bit'} weights, "
                            f"{g.inputs.describe() if g.inputs else '16-bit'} inputs" for g in groups)
        if qcfg.get("transform_config"):
            summary += "; transforms " + ", ".join(qcfg["transform_config"].get("config_groups") or {}) + \
                (f" (run-time: {', '.join(sorted({t.group for t in transforms}))})" if transforms else " (fused)")
        ckpt = CheckpointQuant(self.name, model_dir, summary, ignore)
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, groups, transforms, model, dtype)
        return ckpt

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        """The first config group's weights (mixed-precision checkpoints: its share only)."""
        weights = next((g.weights for g in _groups(qcfg) if g.weights is not None), None)
        if weights is None:
            return None
        per_scale = {"tensor": float("inf"), "channel": in_features, "group": weights.group_size,
                     "tensor_group": weights.group_size}.get(weights.strategy)
        if weights.strategy == "block":
            per_scale = weights.block_structure[0] * weights.block_structure[1]
        scale_bits = 8 if weights.num_bits == 4 and weights.type == "float" else 16  # FP4: FP8 / E8M0 scales
        zero_bits = 0 if weights.symmetric else weights.num_bits
        return weights.num_bits + (scale_bits + zero_bits) / (per_scale or in_features)

    def _load_state(self, ckpt: CheckpointQuant, groups: list[ConfigGroup], transforms: list[OnlineTransform],
                    model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The model's state dict with every quantized weight dequantized; fills
        ``ckpt.layers`` with each layer's scheme and input quantizer."""
        raw = read_tensors(ckpt.model_dir, "model*.safetensors")  # not an oracle.safetensors beside it
        quant_suffixes = tuple("." + t for t in QUANT_TENSORS) + tuple("." + t.tensor for t in transforms)
        state = {k: raw[k].to(dtype) if raw.dtype(k).is_floating_point else raw[k] for k in raw
                 if not k.endswith(quant_suffixes)}
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or any(_matches(p, name, module) for p in ckpt.ignored):
                continue
            group = next((g for g in groups if any(_matches(t, name, module) for t in g.targets)), None)
            if group is None:
                continue
            local = raw.under(name)
            if "weight_g_idx" in local:
                raise SpecftError(f"quant=checkpoint: {name}.weight_g_idx (act-order groups) is not supported yet")
            if group.weights is not None:
                stored = {k: v for k, v in local.items() if "." not in k and k != "bias"}
                ckpt.put_weight(state, name, module, stored,
                                lambda t, g=group, n=name: dequantize_weight(t, g.weights, g.fmt, n), dtype)
            quantize_input = None
            if group.inputs is not None:
                quantize_input = input_quantizer(group.inputs, local, name)
            ckpt.layers[name] = LayerQuant(name, group.weights.describe() if group.weights else "16-bit",
                                           group.inputs.describe() if group.inputs else None, quantize_input)
        _rotate_inputs(ckpt, transforms, model, raw)
        _rotate_attention(ckpt, transforms, model, raw)
        stray = sorted(k[: -len(".weight_scale")] for k in raw if k.endswith(".weight_scale")
                       and k[: -len(".weight_scale")] not in ckpt.layers)
        if stray:  # its codes would be read as 16-bit weights
            raise SpecftError(f"model.path: {stray[0]} has quantized weights that no config group of "
                              f"{ckpt.model_dir / 'config.json'} covers")
        return state


CHECKPOINT_FORMATS.register("compressed-tensors")(CompressedTensors())
