"""compressed-tensors checkpoints (llm-compressor's output; also what msModelSlim and
ModelOpt can export to): ``quantization_config.quant_method == "compressed-tensors"``.

Supported here: the formats ``float-quantized`` (FP8 weights per tensor, channel or
block), ``int-quantized`` and ``naive-quantized`` (INT8 weights), and ``pack-quantized``
(INT1-8 weights packed into int32, per channel or group, with packed zero points), with
16-bit, dynamic or static symmetric activations per tensor, token or group.

The arithmetic is the format's own (compressed_tensors/quantization/lifecycle), written
out here so that specft needs no compressed-tensors at run time, and checked bit for bit
against that library in tests/test_quantized_checkpoints.py:

- weights: ``(q - zero_point) * scale`` in the scale's dtype, the scale broadcast over
  its channel, group or block, then cast to the model's dtype;
- a symmetric scale is ``amax / (range / 2)`` (INT8: /127.5, not /127; FP8: /448), a zero
  scale becomes the dtype's eps, values are ``x / scale`` clamped to the range and rounded
  (INT: half to even; FP8: a cast to float8_e4m3fn), all in the activation's dtype;
- dynamic "token" scales reduce every dim but the first two (a [B, T, H] input: per
  token), as the library does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from specft.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    FormatFamily,
    LayerQuant,
    read_config,
)

QUANT_METHOD = "compressed-tensors"
WEIGHT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
FP8_MAX = 448.0  # float8_e4m3fn
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

    @classmethod
    def parse(cls, raw: dict, where: str) -> CTArgs:
        args = cls(num_bits=int(raw.get("num_bits", 8)), type=raw.get("type", "int"),
                   symmetric=bool(raw.get("symmetric", True)), strategy=raw.get("strategy", "tensor"),
                   group_size=raw.get("group_size"),
                   block_structure=tuple(raw["block_structure"]) if raw.get("block_structure") else None,
                   dynamic=raw.get("dynamic") in (True, "local"))
        supported = {("int", n) for n in range(1, 9)} | {("float", 8)}
        if (args.type, args.num_bits) not in supported:
            raise SpecftError(f"quant=checkpoint: {where} is {args.type}{args.num_bits}, which specft cannot run "
                              "yet; supported: int1-8 and float8 (e4m3)")
        return args

    @property
    def q_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The library's (q_min, q_max), float32 scalars."""
        if self.type == "float":
            return torch.tensor(-FP8_MAX), torch.tensor(FP8_MAX)
        half = 2.0 ** self.num_bits / 2
        return torch.tensor(-half), torch.tensor(half - 1)

    def describe(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.num_bits}"
        shape = {"group": f"group {self.group_size}",
                 "block": f"block {'x'.join(map(str, self.block_structure or ()))}"}.get(self.strategy, self.strategy)
        return f"{kind} {shape}" + ("" if self.symmetric else " asymmetric") + (" dynamic" if self.dynamic else "")


def round_to_grid(x: torch.Tensor, args: CTArgs) -> torch.Tensor:
    """Clamp to the range, round onto the grid, back in x's dtype."""
    lo, hi = args.q_range
    x = torch.clamp(x, lo, hi)
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


def expected_scale_shape(args: CTArgs, out: int, inp: int) -> tuple[int, ...]:
    if args.strategy == "channel":
        return (out, 1)
    if args.strategy == "group":
        return (out, -(-inp // args.group_size))
    if args.strategy == "block":
        b0, b1 = args.block_structure
        return (-(-out // b0), -(-inp // b1))
    return (1,)


def broadcast_scale(t: torch.Tensor, args: CTArgs, shape: tuple[int, int]) -> torch.Tensor:
    """A per-group/block parameter repeated to the weight's shape (channel and tensor
    parameters broadcast as they are)."""
    if args.strategy == "group":
        return t.repeat_interleave(args.group_size, dim=1)[:, : shape[1]]
    if args.strategy == "block":
        b0, b1 = args.block_structure
        return t.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)[: shape[0], : shape[1]]
    return t.reshape(-1, 1) if args.strategy == "channel" else t.reshape(())


def dequantize_weight(tensors: dict[str, torch.Tensor], args: CTArgs, fmt: str, name: str) -> torch.Tensor:
    """The dense weight of one layer, in its scale's dtype."""
    scale = _need(tensors, "weight_scale", name)
    if fmt == "pack-quantized":
        shape = tuple(int(v) for v in _need(tensors, "weight_shape", name).tolist())
        q = unpack_int32(_need(tensors, "weight_packed", name), args.num_bits, shape[1])
    else:
        q = _need(tensors, "weight", name)
        shape = tuple(q.shape)
    want = expected_scale_shape(args, *shape)
    if tuple(scale.shape) != want and not (want == (1,) and scale.numel() == 1):
        raise SpecftError(f"model.path: {name}.weight_scale has shape {list(scale.shape)}, but {args.describe()} "
                          f"scales of a {list(shape)} weight have {list(want)}")
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


def _need(tensors: dict[str, torch.Tensor], key: str, name: str) -> torch.Tensor:
    if key not in tensors:
        raise SpecftError(f"model.path: {name}.{key} is missing from the checkpoint")
    return tensors[key]


# -- activations --------------------------------------------------------------------------

class InputQuantizer:
    """A Linear's input as the checkpoint quantizes it at run time (dynamic: scales from
    each input; static: the checkpoint's ``input_scale``)."""

    def __init__(self, args: CTArgs, scale: torch.Tensor | None = None):
        self.args, self.scale = args, scale

    @property
    def share_key(self):
        """q/k/v (and gate/up) read one tensor: dynamic scales from it are the same for
        each, so SharedInput quantizes it once; static scales are per layer."""
        return ("compressed-tensors", *vars(self.args).values()) if self.args.dynamic else None

    def qparams(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        if not a.dynamic:
            return self.scale.to(x.dtype)
        if a.strategy == "group":
            x = x.unflatten(-1, (-(-x.shape[-1] // a.group_size), a.group_size))
            lo, hi = torch.amin(x, dim=-1), torch.amax(x, dim=-1)
        elif a.strategy == "token" and x.dim() > 2:
            dims = tuple(range(2, x.dim()))
            lo, hi = torch.amin(x, dim=dims, keepdim=True), torch.amax(x, dim=dims, keepdim=True)
        else:  # tensor (and "token" on a 2-D input: the library then reduces everything)
            lo, hi = torch.aminmax(x)
        zero = torch.zeros_like(lo)
        lo, hi = torch.min(lo, zero), torch.max(hi, zero)
        q_lo, q_hi = a.q_range
        scale = torch.max(lo.abs(), hi.abs()) / ((q_hi - q_lo).to(hi.dtype) / 2)
        eps = torch.finfo(scale.dtype).eps
        return torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype), scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.qparams(x)
        if self.args.strategy == "group":
            shape = x.shape
            g = x.unflatten(-1, (-1, self.args.group_size))
            s = scale.unsqueeze(-1)
            return (round_to_grid(g / s, self.args).to(s.dtype) * s).flatten(-2).reshape(shape)
        return round_to_grid(x / scale, self.args).to(scale.dtype) * scale


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


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SpecftError(f"model.path: {model_dir} holds no .safetensors weights")
    return files


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


class CompressedTensors(FormatFamily):
    name = "compressed-tensors"

    def detect(self, model_dir: Path) -> bool:
        if not (model_dir / "config.json").is_file():
            return False
        return (read_config(model_dir).get("quantization_config") or {}).get("quant_method") == QUANT_METHOD

    def open(self, model_dir: Path) -> CheckpointQuant:
        qcfg = read_config(model_dir)["quantization_config"]
        if qcfg.get("kv_cache_scheme"):
            raise SpecftError("quant=checkpoint: this compressed-tensors checkpoint quantizes the KV cache, which "
                              "specft cannot run from a checkpoint yet")
        if qcfg.get("transform_config"):
            raise SpecftError("quant=checkpoint: this compressed-tensors checkpoint carries transforms (Hadamard / "
                              "SpinQuant rotations), which specft cannot run yet")
        groups = _groups(qcfg)
        ignore = list(qcfg.get("ignore") or [])
        summary = "; ".join(f"{g.fmt}: {g.weights.describe() if g.weights else '16-bit'} weights, "
                            f"{g.inputs.describe() if g.inputs else '16-bit'} inputs" for g in groups)
        ckpt = CheckpointQuant(self.name, model_dir, summary, ignore)
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, groups, model, dtype)
        return ckpt

    def _load_state(self, ckpt: CheckpointQuant, groups: list[ConfigGroup], model: nn.Module,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The model's state dict with every quantized weight dequantized; fills
        ``ckpt.layers`` with each layer's scheme and input quantizer."""
        raw = _read_all(ckpt.model_dir)
        quant_suffixes = tuple("." + t for t in QUANT_TENSORS)
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items() if not k.endswith(quant_suffixes)}
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or any(_matches(p, name, module) for p in ckpt.ignored):
                continue
            group = next((g for g in groups if any(_matches(t, name, module) for t in g.targets)), None)
            if group is None:
                continue
            local = {k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")}
            if "weight_g_idx" in local:
                raise SpecftError(f"quant=checkpoint: {name}.weight_g_idx (act-order groups) is not supported yet")
            if group.weights is not None:
                state[f"{name}.weight"] = dequantize_weight(local, group.weights, group.fmt, name).to(dtype)
            quantize_input = None
            if group.inputs is not None:
                scale = None if group.inputs.dynamic else _need(local, "input_scale", name)
                quantize_input = InputQuantizer(group.inputs, scale)
            ckpt.layers[name] = LayerQuant(name, group.weights.describe() if group.weights else "16-bit",
                                           group.inputs.describe() if group.inputs else None, quantize_input)
        stray = sorted(k[: -len(".weight_scale")] for k in raw if k.endswith(".weight_scale")
                       and k[: -len(".weight_scale")] not in ckpt.layers)
        if stray:  # its codes would be read as 16-bit weights
            raise SpecftError(f"model.path: {stray[0]} has quantized weights that no config group of "
                              f"{ckpt.model_dir / 'config.json'} covers")
        return state


CHECKPOINT_FORMATS.register("compressed-tensors")(CompressedTensors())
