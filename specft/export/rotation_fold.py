"""`specft fold-rotation CHECKPOINT OUT_DIR --rotation SOURCE`: make a 16-bit EAGLE-3
draft read a target whose residual stream is rotated (x -> x @ R1, quant/rotation.py),
with no retraining.

The draft reads two things from the target: the aux layers' outputs (rotated) and the
token embedding it shares with the target when served (rotated too). So:
- fc: W[:, block j] <- W[:, block j] @ R1 for each aux layer j (fc(x @ R1) = fc(x));
- the first layer's embedding norm: its scale is fused into the embedding half of q/k/v,
  W[:, :H] <- (W[:, :H] * gamma) @ R1, and set to ones (norm(e @ R1) = norm(e) @ R1
  without a scale);
- its frozen embedding copy <- E @ R1, the target's rotated one.
In float64 the folded draft on the rotated target computes what the original computes on
the original target. R1 comes from target_model/rotation_source.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from specft.common.errors import SpecftError
from specft.target_model.rotation_source import ROTATED, UNKNOWN, rotation_matrix, target_basis


def fold_into_eagle3(state: dict[str, torch.Tensor], meta: dict, r1: torch.Tensor) -> dict[str, torch.Tensor]:
    """The folded state dict (new tensors, same dtypes)."""
    width = meta.get("target_hidden_size") or meta["hidden_size"]
    out = dict(state)

    def set_(name, fn):
        out[name] = fn(state[name].double()).to(state[name].dtype)

    blocks = state["fc.weight"].shape[1] // width
    set_("fc.weight", lambda w: torch.cat([w[:, j * width:(j + 1) * width] @ r1 for j in range(blocks)], 1))
    if meta["hidden_size"] == width:  # the draft reads the target's embedding (not one it learned)
        gamma = state["midlayer.input_layernorm.weight"].double()
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"midlayer.self_attn.{proj}.weight"
            set_(name, lambda w: torch.cat([(w[:, :width] * gamma) @ r1, w[:, width:]], 1))
        set_("midlayer.input_layernorm.weight", torch.ones_like)
        set_("embed_tokens.weight", lambda e: e @ r1)
    return out


def trained_basis(folder: Path, meta: dict) -> str:
    """The basis the draft at ``folder`` reads: draft_config.json's record, or for a draft
    trained before it was recorded, the one its run config (config.yaml) implies."""
    if meta.get("basis"):
        return meta["basis"]
    run_config = folder / "config.yaml"
    if not run_config.is_file():
        return UNKNOWN
    try:
        cfg = OmegaConf.load(run_config)
        quant = SimpleNamespace(name=cfg.quant.name, rotation=cfg.quant.get("rotation"))
        return target_basis(quant, cfg.model.get("path"))
    except Exception:  # a run config this version cannot read says nothing of the basis
        return UNKNOWN


def fold_rotation(checkpoint: str | Path, out_dir: str | Path, source: str, overwrite: bool = False) -> Path:
    """Write OUT_DIR: the draft checkpoint at ``checkpoint`` folded for the rotation
    ``source``, a checkpoint folder that `specft eval` and `specft export` read."""
    from specft.common.lock import sibling_lock
    from specft.eval.drafts import load_draft, resolve_checkpoint
    from specft.export.files import check_out_dir, write_files_atomically

    folder = resolve_checkpoint(checkpoint, "checkpoint")
    out = check_out_dir(Path(out_dir).expanduser(), overwrite)
    _, meta = load_draft(folder, field="checkpoint")  # a damaged checkpoint is one line, first
    if meta.get("architecture", "eagle3") != "eagle3":
        raise SpecftError(f"checkpoint: {folder} holds an {meta['architecture']} draft; fold-rotation folds "
                          "EAGLE-3 drafts")
    if meta.get("draft_quant"):
        raise SpecftError(f"checkpoint: {folder} is quantization-aware (draft.quant={meta['draft_quant']}); folding "
                          "would move its weights off their grid: fold a 16-bit draft")
    if meta.get("rotation"):
        raise SpecftError(f"checkpoint: {folder} is already folded ({meta['rotation']})")
    if trained_basis(folder, meta) == ROTATED:  # its weights read the rotated stream already
        raise SpecftError(f"checkpoint: {folder} was trained on a rotated target's features, so it reads the rotated "
                          "stream already and folding R1 would rotate it twice; fold-rotation is for drafts "
                          "trained on the unrotated model")
    r1, record = rotation_matrix(source, meta.get("target_hidden_size") or meta["hidden_size"])
    state = fold_into_eagle3(load_file(str(folder / "draft.safetensors")), meta, r1)
    with sibling_lock(out, "out_dir", "specft fold-rotation"):  # one writer; checked again under the lock
        check_out_dir(out, overwrite)
        write_files_atomically(out, state, {**meta, "rotation": record},
                               names=("draft.safetensors", "draft_config.json"))
        if (folder / "config.yaml").exists():
            shutil.copyfile(folder / "config.yaml", out / "config.yaml")  # the target facts export reads
    return out


def recover_rotation(base_embedding: torch.Tensor, rotated_embedding: torch.Tensor,
                     base_head: torch.Tensor | None = None,
                     rotated_head: torch.Tensor | None = None) -> tuple[torch.Tensor, float, bool]:
    """R1 from the two checkpoints' embeddings (rotated = base @ R1; embeddings are kept in
    high precision by every rotating quantizer here): the orthogonal Procrustes solution,
    R = U V^T from the SVD of base^T rotated, in float64. llm-compressor's SpinQuant first
    centers each embedding row (subtracts its mean), so the base is tried as is and
    centered, and the better fit kept. A centered embedding says nothing of where R1 sends
    the direction of the mean (every row is orthogonal to it), and the SVD picks a sign
    there at random: the untied lm_heads (rotated = base @ R1, never centered) pin it, so
    they join the fit when given. Returns (R, relative residual |base @ R - rotated| /
    |rotated|, whether the base was centered); for an exact rotation the residual is the
    storage rounding."""
    a, b = base_embedding.double(), rotated_embedding.double()
    if a.shape != b.shape:
        raise SpecftError(f"recover rotation: the embeddings differ in shape ({tuple(a.shape)} vs {tuple(b.shape)})")
    heads = (base_head.double(), rotated_head.double()) if base_head is not None and rotated_head is not None else None
    fits = []
    for centered, base in ((False, a), (True, a - a.mean(-1, keepdim=True))):
        x, y = (torch.cat([base, heads[0]]), torch.cat([b, heads[1]])) if heads else (base, b)
        u, _, vt = torch.linalg.svd(x.T @ y)
        r = u @ vt
        fits.append((((x @ r - y).norm() / y.norm()).item(), centered, r))
    residual, centered, r = min(fits, key=lambda f: f[0])
    return r, residual, centered
