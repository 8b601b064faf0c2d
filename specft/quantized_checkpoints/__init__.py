"""Quantized checkpoints as they are served: ``quant=checkpoint``.

A quantizer (llm-compressor, ModelOpt, msModelSlim, llama.cpp's tools) writes a checkpoint
whose files say how it is served: low-bit weights with their scales, and how activations
(and the KV cache) are quantized at run time. specft runs that model, not its own
emulation of the nominal format: each format family (one module here, registered in
CHECKPOINT_FORMATS) detects its files, dequantizes the weights exactly as the format
defines them, and installs the run-time activation quantization the checkpoint records.

Families a user may meet but specft does not run yet are registered too, so that such a
checkpoint is named in one line with the supported ones instead of loading wrong.
"""

from __future__ import annotations

from pathlib import Path

from specft.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    FormatFamily,
    read_config,
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


def supported() -> list[str]:
    return [n for n in CHECKPOINT_FORMATS.names if CHECKPOINT_FORMATS.get(n).supported]


def open_checkpoint(model_dir: str | Path) -> CheckpointQuant | None:
    """What the checkpoint at ``model_dir`` quantizes, parsed and checked; None when it
    is not quantized. An unsupported family or scheme is one line naming it."""
    family = detect_family(model_dir)
    if family is None:
        return None
    if not family.supported:
        raise SpecftError(f"quant=checkpoint: {model_dir} is a {family.name} checkpoint, which specft cannot "
                          f"run yet; supported: {', '.join(supported())} (docs/checkpoints.md)")
    return family.open(Path(model_dir))


# The families register themselves on import.
from specft.quantized_checkpoints import compressed_tensors, gguf_family, gpt_oss, gptq, hf_fp8, modelopt, msmodelslim, others  # noqa: E402,F401,I001

__all__ = ["CHECKPOINT_FORMATS", "CheckpointQuant", "FormatFamily", "description_patterns", "detect_family",
           "open_checkpoint", "read_config", "stored_bits", "supported"]
