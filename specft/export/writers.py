"""`specft export CHECKPOINT OUT_DIR --layout NAME`: the layout (drafts/layouts.py's LAYOUTS,
gguf included) names the writer that makes its files; each writer takes the options it
declares, and an option another writer owns is refused rather than ignored."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specft.common.errors import SpecftError
from specft.drafts.layouts import LAYOUTS
from specft.export.gguf import export_gguf
from specft.export.safetensors import export_draft


@dataclass(frozen=True)
class ExportOptions:
    quant: str = "auto"  # safetensors: the packed weight format (auto: the draft's QAT format)
    target_head: str | None = None  # safetensors: the cache's target_head.safetensors (mtp, reduced vocab)
    dtype: str = "bfloat16"  # safetensors: the unquantized tensors' dtype
    gguf_type: str = "f16"  # gguf: the draft's weight type
    gguf_vocab: str = "target"  # gguf: target (the tokenizer's copy) or none (export/gguf.py GGUF_VOCABULARIES)
    target: str | None = None  # gguf: the target checkpoint or .gguf whose vocabulary the draft carries
    overwrite: bool = False


def _write_safetensors(checkpoint, out_dir, layout: str, o: ExportOptions) -> Path:
    return export_draft(checkpoint, out_dir, layout, o.quant, o.target_head, o.dtype, o.overwrite)


def _write_gguf(checkpoint, out_dir, layout: str, o: ExportOptions) -> Path:
    return export_gguf(checkpoint, out_dir, o.target, o.overwrite, o.gguf_type, o.gguf_vocab)


@dataclass(frozen=True)
class Writer:
    write: Callable[..., Path]
    # The options only this writer reads -> the line when a layout of another writer is given one.
    own_options: dict[str, str] = field(default_factory=dict)


WRITERS = {"safetensors": Writer(_write_safetensors),
           "gguf": Writer(_write_gguf, {"gguf_type": "--gguf-type {}: only --layout gguf writes GGUF weights",
                                        "gguf_vocab": "--gguf-vocab {}: only --layout gguf writes a GGUF vocabulary"})}


def export(checkpoint: str | Path, out_dir: str | Path, layout: str = "eagle3",
           options: ExportOptions = ExportOptions()) -> Path:
    writer = WRITERS[LAYOUTS.get(layout, "--layout").writer]
    for other in WRITERS.values():
        for option, line in other.own_options.items() if other is not writer else ():
            if getattr(options, option) != getattr(ExportOptions, option):
                raise SpecftError(line.format(getattr(options, option)))
    return writer.write(checkpoint, out_dir, layout, options)
