"""What every quantized-checkpoint format family provides."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specft.errors import SpecftError
from specft.registry import Registry

CHECKPOINT_FORMATS: Registry = Registry("quantized checkpoint format")


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SpecftError(f"model.path: cannot read {path} ({err})") from None


def read_config(model_dir: Path) -> dict:
    return read_json(Path(model_dir) / "config.json")


def quant_method(model_dir: Path) -> str | None:
    """config.json's quantization_config.quant_method (None: no config.json or none set)."""
    if not (Path(model_dir) / "config.json").is_file():
        return None
    return (read_config(model_dir).get("quantization_config") or {}).get("quant_method")


def read_tensors(model_dir: Path, pattern: str) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files matching ``pattern`` (an index json, when there
    is one, names them); other safetensors beside them (an oracle's outputs) are not read."""
    index = next(iter(sorted(model_dir.glob(pattern + ".index.json"))), None)
    files = [model_dir / n for n in sorted(set(read_json(index)["weight_map"].values()))] if index else \
        sorted(model_dir.glob(pattern))
    if not files:
        raise SpecftError(f"model.path: {model_dir} holds no {pattern} weights")
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def need(tensors: dict[str, torch.Tensor], key: str, where: str = "") -> torch.Tensor:
    """A tensor the format requires, or one line naming it (``where``: the layer, when
    ``tensors`` holds one layer's by their local names)."""
    if key not in tensors:
        raise SpecftError(f"model.path: {where + '.' if where else ''}{key} is missing from the checkpoint")
    return tensors[key]


class PackedLinear(nn.Module):
    """A quantized Linear kept as the checkpoint stores it (``model.checkpoint_weights=
    packed``): its stored tensors (codes, scales, zero points) as buffers, the dense weight
    made by the family's own dequantization on every forward and dropped after, so the
    model holds a layer's weight at its stored width and one dense layer at a time. The
    weight it makes is the one the dense load stores: the forward is the same, bit for bit."""

    def __init__(self, in_features: int, out_features: int, stored: dict[str, torch.Tensor],
                 dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor], dtype: torch.dtype,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.names = sorted(stored)
        for key in self.names:
            self.register_buffer(f"stored_{key}", stored[key], persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dequantize = dequantize

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, made anew on each access; contiguous as a loaded parameter is
        (a transposed view would take another GEMM route and round otherwise)."""
        return self._dequantize({k: getattr(self, f"stored_{k}") for k in self.names}).to(self.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.names}"


@dataclass
class LayerQuant:
    """One quantized layer as the checkpoint serves it."""

    name: str
    weight: str  # e.g. "int4 group 32 asymmetric"
    activation: str | None  # e.g. "int8 token dynamic", None: 16-bit inputs
    # x -> x quantized and dequantized as the serving kernel sees it (None: not quantized)
    quantize_input: Callable[[torch.Tensor], torch.Tensor] | None = None
    # x -> the layer's output, replacing the Linear's forward where the serving kernel's
    # arithmetic is not a float matmul of dequantized operands (integer accumulation)
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class CheckpointQuant:
    """A quantized checkpoint opened: its family, the layers it quantizes, and how to
    get the dense weights the model computes with."""

    family: str
    model_dir: Path
    summary: str  # one line: the scheme(s), e.g. "float-quantized: fp8 channel weights, fp8 token dynamic inputs"
    ignored: list[str] = field(default_factory=list)
    layers: dict[str, LayerQuant] = field(default_factory=dict)
    load_state: Callable[[nn.Module, torch.dtype], dict[str, torch.Tensor]] | None = None
    # (query, key, value) -> (query, key, value), run on every attention call after RoPE
    # (quant.model_hooks.install_attention_transform): rotations the checkpoint leaves for
    # run time there (SpinQuant's R3); each has a ``description``
    attention: list[Callable] = field(default_factory=list)
    # the model's config where config.json does not hold it (a GGUF's header)
    load_config: Callable[[], object] | None = None
    # the dtype the served arithmetic runs in, whatever model.dtype says (llama.cpp: float32)
    compute_dtype: torch.dtype | None = None
    # model.checkpoint_weights=packed: quantized layers stay stored (put_weight fills
    # packed_layers instead of the state dict; the loader swaps in PackedLinear modules)
    packed: bool = False
    packed_layers: dict[str, PackedLinear] = field(default_factory=dict)

    def put_weight(self, state: dict[str, torch.Tensor], name: str, module: nn.Module,
                   stored: dict[str, torch.Tensor], dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                   dtype: torch.dtype) -> None:
        """One quantized layer's weight: dequantized into ``state`` now, or (packed) kept
        as ``stored`` with the same ``dequantize`` for its PackedLinear."""
        if not self.packed:
            state[f"{name}.weight"] = dequantize(stored).to(dtype)
            return
        dequantize(stored)  # a bad shape or index is refused at load, not at the first forward
        state.pop(f"{name}.weight", None)  # stored codes some families passed through (int8 "weight")
        bias = state.pop(f"{name}.bias", None)
        self.packed_layers[name] = PackedLinear(module.in_features, module.out_features, stored, dequantize, dtype,
                                                bias)

    def to_dict(self) -> dict:
        out = {"family": self.family, "summary": self.summary, "ignored": self.ignored,
               "layers": {n: {"weight": q.weight, "activation": q.activation} for n, q in self.layers.items()}}
        return {**out, "attention": [t.description for t in self.attention]} if self.attention else out


class FormatFamily:
    """One family: ``detect`` looks at the files, ``open`` parses them."""

    name: str = ""
    supported: bool = True
    # whether its layers can stay stored (model.checkpoint_weights=packed): it fills its
    # weights through CheckpointQuant.put_weight
    packs: bool = False
    # files beside config.json that say how the checkpoint is quantized: their contents
    # are part of the cache key's checkpoint fingerprint, as config.json's are
    description_files: tuple[str, ...] = ()

    def detect(self, model_dir: Path) -> bool:
        raise NotImplementedError

    def open(self, model_dir: Path) -> CheckpointQuant:
        raise NotImplementedError

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        """Bits per quantized Linear weight element as the checkpoint stores it (codes and
        their scales, zero points), from ``quantization_config`` alone, for ``specft plan``;
        None where the family does not say (plan then counts 16)."""
        return None
