"""`specft export CHECKPOINT OUT_DIR`: a trained draft in a layout serving engines load,
in 16 bit or quantized (FP8 per-channel, MXFP4 packed) with compressed-tensors metadata."""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from specft.drafts import DRAFT_ARCHS
from specft.drafts.layouts import LAYOUTS
from specft.errors import SpecftError
from specft.export.packing import PACKERS, compressed_tensors_config
from specft.export.verifier import verifier_facts
from specft.lock import sibling_lock
from specft.paths import require_writable_dir

log = logging.getLogger(__name__)

QUANT_KINDS = ("none", "auto", "fp8", "mxfp4")


def _meta(folder: Path, draft_config: dict) -> dict:
    """The checkpoint's draft_config.json (as load_draft read it) plus the target's depth
    from the run config beside it."""
    meta = dict(draft_config)
    run = yaml.safe_load((folder / "config.yaml").read_text()) if (folder / "config.yaml").exists() else {}
    meta["target_num_layers"] = (run.get("model") or {}).get("num_layers")
    meta["verifier"] = verifier_facts(folder, draft_config)
    return meta


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
    meta = _meta(folder, draft_config)
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


def check_out_dir(out: Path, overwrite: bool) -> Path:
    """Refuse, before any work, an output that is a file, is not writable, or holds other
    files (unless ``overwrite``)."""
    require_writable_dir(out, "out_dir")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        names = sorted(p.name for p in out.iterdir())
        raise SpecftError(f"out_dir: {out} is not empty ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                          "give a new directory, or --overwrite to replace its export files")
    return out


def write_files_atomically(out: Path, tensors: dict, config: dict,
                           names: tuple[str, str] = ("model.safetensors", "config.json")) -> None:
    """The tensors and config as ``names``, each written beside its final name, then
    renamed (a failed write leaves the old files whole); readable by every user
    (safetensors writes 0600), as a server running as another user must read them."""
    tensors_name, config_name = names
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = {name: out / f".{name}.tmp" for name in names}
        save_file(tensors, str(tmp[tensors_name]), metadata={"format": "pt"})
        tmp[config_name].write_text(json.dumps(config, indent=2))
        for name, path in tmp.items():
            os.chmod(path, 0o644)
            os.replace(path, out / name)
    except OSError as err:
        raise SpecftError(f"out_dir: cannot write {out}: {err.strerror or err}") from None


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
