"""Which family a checkpoint is, from its files: detected, opened and checked; and a
checkpoint without a quantization_config checked to hold plain weights."""

from __future__ import annotations

from pathlib import Path

import torch

from specft.common.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    FormatFamily,
    format_boundary,
    quant_method,
    read_config,
    read_tensors,
)


def detect_family(model_dir: str | Path) -> FormatFamily | None:
    """The format family whose files are in ``model_dir`` (or that a .gguf file is); None
    for an unquantized checkpoint (or a hub id, which is not read here)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir() and model_dir.suffix != ".gguf":
        return None
    for name in CHECKPOINT_FORMATS.names:
        family = CHECKPOINT_FORMATS.get(name)
        if family.detect(model_dir):
            return family
    return None


def description_patterns() -> list[str]:
    """Every family's quantization description files (for the checkpoint fingerprint)."""
    return [p for n in CHECKPOINT_FORMATS.names for p in CHECKPOINT_FORMATS.get(n).description_files]


def stored_bits(model_dir: str | Path, in_features: float) -> tuple[str, float | None] | None:
    """(family, bits per quantized Linear weight element as stored) of the checkpoint at
    ``model_dir`` from its config alone (no weights read); None when it is not quantized."""
    family = detect_family(model_dir)
    if family is None:
        return None
    config = Path(model_dir) / "config.json"
    qcfg = (read_config(Path(model_dir)).get("quantization_config") or {}) if config.is_file() else {}
    return family.name, family.stored_bits(qcfg, in_features)


def family_of_method(method: str | None) -> FormatFamily | None:
    """The family a config.json's quant_method names (by its registry name or the methods
    it declares)."""
    for name in CHECKPOINT_FORMATS.names:
        family = CHECKPOINT_FORMATS.get(name)
        if method is not None and (method == name or method in family.methods):
            return family
    return None


def supported() -> list[str]:
    return [n for n in CHECKPOINT_FORMATS.names if CHECKPOINT_FORMATS.get(n).supported]


# tensor names only quantized checkpoints hold (scales, packed codes, zero points)
QUANTIZED_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale", ".qweight", ".qzeros",
                      ".weight_packed", ".weight_zero_point", "_blocks", "_scales", ".deq_scale", ".quant_bias")
# dtypes of quantized codes (a plain checkpoint's int64 / bool buffers are not)
CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32)


def check_unquantized(model_dir: str | Path) -> None:
    """A checkpoint without a quantization_config must hold plain 16/32-bit weights: one
    whose config lost it would load its codes as weights and drop its scales. Reads the
    safetensors headers only."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir() or not any(model_dir.glob("model*.safetensors")):
        return
    method = quant_method(model_dir)
    family = family_of_method(method)
    if family is not None and family.description_files:  # the family is read from a file that is not here
        raise SpecftError(f"model.path: {model_dir}'s quantization_config names quant_method {method!r}, but the "
                          f"{family.name} checkpoint's {' / '.join(family.description_files)} is missing; copy it "
                          "from the quantizer's output beside config.json")
    if method is not None:
        raise SpecftError(f"model.path: {model_dir}'s quantization_config names quant_method {method!r}, which "
                          f"specft does not know; supported: {', '.join(supported())} (docs/checkpoints.md)")
    tensors = read_tensors(model_dir, "model*.safetensors")
    found = next(((k, f"a {k.rsplit('.', 1)[-1]} tensor") for k in tensors if k.endswith(QUANTIZED_SUFFIXES)), None) \
        or next(((k, str(tensors.dtype(k)).replace("torch.", "")) for k in tensors
                 if tensors.dtype(k) in CODE_DTYPES), None)
    if found is not None:
        raise SpecftError(f"model.path: {model_dir} has no quantization_config, but its weights are quantized "
                          f"({found[0]}: {found[1]}); restore the quantization_config its quantizer wrote and run "
                          "it with quant=checkpoint")


def open_checkpoint(model_dir: str | Path) -> CheckpointQuant | None:
    """What the checkpoint at ``model_dir`` quantizes, parsed and checked; None when it
    is not quantized. An unsupported family or scheme is one line naming it."""
    family = detect_family(model_dir)
    if family is None:
        return None
    if not family.supported:
        raise SpecftError(f"quant=checkpoint: {model_dir} is a {family.name} checkpoint, which specft cannot "
                          f"run yet; supported: {', '.join(supported())} (docs/checkpoints.md)")
    with format_boundary(family.name, model_dir):
        return family.open(Path(model_dir))
