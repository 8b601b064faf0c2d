"""What every quantized-checkpoint format family provides."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specft.common.errors import SpecftError, first_line
from specft.common.registry import Registry

CHECKPOINT_FORMATS: Registry = Registry("quantized checkpoint format")


# What a family's parsing of a damaged or hand-edited checkpoint raises: a field of another
# type (int(None), a list where a name goes), a key or tensor it assumed, codes of another
# dtype than the header says, a safetensors header that does not describe its file.
UNREADABLE = (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, SafetensorError)


@contextlib.contextmanager
def format_boundary(family: str, where):
    """Whatever a family's reading of an untrusted checkpoint raises beyond its own checks
    becomes one line naming the checkpoint (the fuzz suite, tests/test_fuzz.py, found
    these by mutating each family's fixture)."""
    try:
        yield
    except UNREADABLE as err:
        message = first_line(err)
        raise SpecftError(f"model.path: the {family} checkpoint at {where} is not as its quantizer writes it "
                          f"({type(err).__name__}: {message}); its quantization config or weights are damaged "
                          "or were edited: restore them from the quantizer's output") from None


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


# safetensors' header names for the dtypes a checkpoint holds (anything else is read to tell)
HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                 "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class LazyTensors(Mapping):
    """A checkpoint's tensors by name, each read from its file when asked for and not
    kept: a family walking the model layer by layer holds one layer's stored tensors at a
    time, which is what lets a sharded load stay within a rank's share (``dtype`` and
    ``under`` answer from the files' headers without reading data)."""

    def __init__(self, files: list[Path]):
        self._file, self._dtype, self._below = {}, {}, {}
        for path in files:
            with _opened(path) as f:
                for key in f.keys():
                    self._file[key] = path
                    self._dtype[key] = HEADER_DTYPES.get(f.get_slice(key).get_dtype())
                    parts = key.split(".")
                    for depth in range(1, len(parts)):  # every module above it
                        self._below.setdefault(".".join(parts[:depth]), []).append(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        with _opened(self._file[key]) as f:
            return f.get_tensor(key)

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def __contains__(self, key) -> bool:
        return key in self._file

    def dtype(self, key: str) -> torch.dtype:
        return self._dtype[key] if self._dtype[key] is not None else self[key].dtype

    def get_dtype(self, key: str) -> torch.dtype | None:
        """The dtype of ``key``; None when the checkpoint has no such tensor."""
        return self.dtype(key) if key in self._file else None

    def under(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of module ``name`` by their local names (``qweight``, ``weight_scale``)."""
        return {k[len(name) + 1:]: self[k] for k in self._below.get(name, ())}


@contextlib.contextmanager
def _opened(path: Path):
    """A weights file, or one line when its header does not describe it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise SpecftError(f"model.path: {path} is not a readable safetensors file ({str(err)[:200]})") from None
    with handle as f:
        try:
            yield f
        except SafetensorError as err:
            raise SpecftError(f"model.path: {path} does not hold what its header says ({str(err)[:200]})") from None


def read_tensors(model_dir: Path, pattern: str) -> LazyTensors:
    """The tensors of the weight files matching ``pattern`` (an index json, when there
    is one, names them); other safetensors beside them (an oracle's outputs) are not read."""
    index = next(iter(sorted(model_dir.glob(pattern + ".index.json"))), None)
    files = [model_dir / n for n in sorted(set(read_json(index)["weight_map"].values()))] if index else \
        sorted(model_dir.glob(pattern))
    if not files:
        raise SpecftError(f"model.path: {model_dir} holds no {pattern} weights")
    return LazyTensors(files)


def need(tensors: dict[str, torch.Tensor], key: str, where: str = "") -> torch.Tensor:
    """A tensor the format requires, or one line naming it (``where``: the layer, when
    ``tensors`` holds one layer's by their local names)."""
    if key not in tensors:
        raise SpecftError(f"model.path: {where + '.' if where else ''}{key} is missing from the checkpoint")
    return tensors[key]


def check_finite(name: str, tensor: torch.Tensor, where: str | Path) -> torch.Tensor:
    """A weight as the checkpoint stores it, dequantized, must be finite: a NaN or Inf
    scale is a damaged file, named here at load (later it would surface as non-finite
    hidden states, with another cause guessed)."""
    if tensor.is_floating_point() and tensor.device.type != "meta" and not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise SpecftError(f"model.path: {name} in the checkpoint at {where} holds {bad} non-finite values (NaN/Inf) "
                          "once dequantized; the file is damaged: download or quantize it again")
    return tensor


def release_freed_memory() -> None:
    """Hands freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere).
    A packed load keeps each layer's small stored tensors and frees the dense weight it
    made to check them: glibc, whose mmap threshold has grown past a layer's size, puts
    those dense weights on the heap between the kept tensors, and without a trim the
    process keeps every freed one (SmolLM2 GPTQ, bfloat16: 1.3 GB resident instead of
    0.55 GB)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


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
    # (state-dict name, dense tensor) -> None: where put_weight sends a dense weight the
    # moment it is made instead of ``state`` (a ZeRO-3 load writes it into its partition)
    sink: Callable[[str, torch.Tensor], None] | None = None
    # fused experts module -> (gate/up input quantizer, down input quantizer), None for
    # weight-only experts (filled by the loader; experts.expert_input_quantizers)
    experts: dict[str, tuple | None] = field(default_factory=dict)
    # a GGUF target (gguf_family.py): its file, and each tensor's ggml type by GGUF name
    gguf_file: Path | None = None
    tensor_types: dict[str, str] = field(default_factory=dict)

    def put_weight(self, state: dict[str, torch.Tensor], name: str, module: nn.Module,
                   stored: dict[str, torch.Tensor], dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                   dtype: torch.dtype) -> None:
        """One quantized layer's weight: dequantized into ``state`` now, or (packed) kept
        as ``stored`` with the same ``dequantize`` for its PackedLinear."""
        if self.sink is not None:
            self.sink(f"{name}.weight", check_finite(f"{name}.weight", dequantize(stored).to(dtype), self.model_dir))
            return
        if not self.packed:
            state[f"{name}.weight"] = dequantize(stored).to(dtype)
            return
        # a bad shape, index or scale is refused at load, not at the first forward
        check_finite(f"{name}.weight", dequantize(stored), self.model_dir)
        release_freed_memory()
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
    # config.json quant_method values that name this family besides its registry name
    # (a checkpoint that names it but lacks its description file is told which file)
    methods: tuple[str, ...] = ()

    def detect(self, model_dir: Path) -> bool:
        raise NotImplementedError

    def open(self, model_dir: Path) -> CheckpointQuant:
        raise NotImplementedError

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        """Bits per quantized Linear weight element as the checkpoint stores it (codes and
        their scales, zero points), from ``quantization_config`` alone, for ``specft plan``;
        None where the family does not say (plan then counts 16)."""
        return None


class QuantMethodFamily(FormatFamily):
    """A family config.json names by ``quantization_config.quant_method`` (``method``)."""

    method: str = ""

    def detect(self, model_dir: Path) -> bool:
        return quant_method(model_dir) == self.method

    @staticmethod
    def quantization_config(model_dir: Path) -> dict:
        return read_config(model_dir)["quantization_config"]
