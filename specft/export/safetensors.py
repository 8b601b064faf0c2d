"""The safetensors layouts (eagle3, speculators, mtp, peagle, dflash: each registered by
its draft folder's export.py): a trained draft in 16 bit or quantized (FP8 per-channel,
MXFP4 packed) with compressed-tensors metadata."""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from specft.common.errors import SpecftError
from specft.common.lock import sibling_lock
from specft.drafts import DRAFT_ARCHS
from specft.drafts.layouts import LAYOUTS
from specft.export.files import check_out_dir, draft_meta, write_files_atomically
from specft.export.packing import PACKERS, compressed_tensors_config

log = logging.getLogger(__name__)

QUANT_KINDS = ("none", "auto", "fp8", "mxfp4")


def _quant_spec(kind: str, meta: dict):
    """(packer name, QuantConfig) for the export; auto follows the draft's QAT format."""
    from specft.quant.config import load_quant_config

    if kind == "auto":
        kind = {"fp8": "fp8", "mxfp4": "mxfp4"}.get(meta.get("draft_quant") or "", "none")
        if meta.get("draft_quant") and kind == "none":
            raise SpecftError(f"export: no packed layout for draft.quant={meta['draft_quant']}; "
                              f"use --quant none, fp8 or mxfp4")
    if kind == "none":
        return None, None
    return kind, load_quant_config(kind, "--quant")


def _quantize(tensors: dict, kind: str, qcfg, linear_names: set[str]) -> tuple[dict, list[str]]:
    """Pack the weights of Linear layers not excluded by the quant config; the rest stay 16-bit."""
    out, ignored = {}, []
    for name, t in tensors.items():
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in linear_names:
            if any(fnmatch.fnmatch(layer, pat) for pat in qcfg.exclude):
                ignored.append(layer)
            else:
                out.update({f"{layer}.{k}": v for k, v in PACKERS[kind](t, qcfg.weight).items()})
                continue
        out[name] = t
    return out, ignored


def _sixteen_bit(tensors: dict, dtype: torch.dtype) -> dict:
    """Cast the unquantized float tensors; packed weights and their scales keep their dtypes."""
    def keep(name, t):
        return not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or name.endswith("_scale")

    return {k: (v if keep(k, v) else v.to(dtype)).contiguous() for k, v in tensors.items()}


def export_draft(checkpoint: str | Path, out_dir: str | Path, layout: str = "eagle3", quant: str = "auto",
                 target_head: str | None = None, dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    from specft.eval.drafts import load_draft, resolve_checkpoint

    folder = resolve_checkpoint(checkpoint, "checkpoint")
    out = check_out_dir(Path(out_dir).expanduser(), overwrite)
    if quant not in QUANT_KINDS:
        raise SpecftError(f"--quant: unknown value {quant!r}; allowed: {', '.join(QUANT_KINDS)}")
    draft, draft_config = load_draft(folder, field="checkpoint")  # a damaged checkpoint is one line, first
    meta = draft_meta(folder, draft_config)
    arch = meta.get("architecture", "eagle3")
    fmt = LAYOUTS.get(layout, "--layout")()
    carried_by = DRAFT_ARCHS.get(arch, "architecture").layouts
    if layout not in carried_by:
        raise SpecftError(f"--layout {layout}: the checkpoint holds an {arch} draft; "
                          f"use --layout {' or '.join(carried_by)}")
    state = {k: v.detach() for k, v in draft.state_dict().items()}
    meta.update(num_layers=meta.get("num_layers", 1),
                learned_embedding=meta["hidden_size"] != meta.get("target_hidden_size", meta["hidden_size"]))
    head = load_file(target_head)["lm_head"] if target_head else None
    tensors = fmt.tensors(state, meta, head)
    config = fmt.config(meta)
    kind, qcfg = _quant_spec(quant, meta)
    linear_names = _linear_names(draft, tensors, state)
    if kind:
        tensors, ignored = _quantize(tensors, kind, qcfg, linear_names)
        config["quantization_config"] = compressed_tensors_config(kind, ignored, qcfg.activation)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    config["torch_dtype"] = dtype
    config["specft"] = {"source_checkpoint": str(folder), "architecture": arch, "layout": layout,
                        "aux_layer_ids_specft": meta["aux_layer_ids"], "quant": kind or "none",
                        "target_model": meta.get("target_model"), "target_quant": meta.get("quant"),
                        "target_path": meta["verifier"]["name_or_path"]}
    # One writer at a time; the folder is checked again under the lock, since another
    # export may have filled it since the check above.
    with sibling_lock(out, "out_dir", "specft export"):
        check_out_dir(out, overwrite)
        write_files_atomically(out, _sixteen_bit(tensors, torch_dtype), config)
    log.info("export: %s layout, %s weights, %d tensors -> %s", layout, kind or dtype, len(tensors), out)
    return out


def _linear_names(draft, exported: dict, state: dict) -> set[str]:
    """Exported names of the draft's Linear layers (renamed the way the layout renamed
    their weights)."""
    by_tensor = {id(v): k for k, v in exported.items()}
    names = set()
    for name, module in draft.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in state:
            exported_name = by_tensor.get(id(state[f"{name}.weight"]))
            if exported_name:
                names.add(exported_name.removesuffix(".weight"))
    return names
