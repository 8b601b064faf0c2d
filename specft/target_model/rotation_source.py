"""Where a rotated target's R1 comes from: a quant config's rotation block (rebuilt from
its kind and seed), a checkpoint folder whose quantizer saved it (msModelSlim's QuaRot:
optional/quarot.safetensors), or a .safetensors file holding the matrix (one recovered
from two checkpoints by scripts/recover_rotation.py). `specft fold-rotation` and
trainer.unrotate both read it here."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from specft.common.errors import ConfigError, SpecftError

ORTHOGONALITY_TOLERANCE = 1e-4  # a saved or recovered matrix in float32 is orthogonal to ~1e-6


def rotation_matrix(source: str, size: int, field: str = "--rotation") -> tuple[torch.Tensor, dict]:
    """(R1 in float64, a record of where it came from); errors name ``field``."""
    if source.endswith(".safetensors"):
        return _matrix_file(Path(source).expanduser(), size, field), {"file": str(Path(source).expanduser().resolve())}
    if Path(source).expanduser().is_dir():
        folder = Path(source).expanduser().resolve()
        return _checked(_saved_matrix(folder, field), size, str(folder), field), {"checkpoint": str(folder)}
    from specft.quant.config import load_quant_config

    rotation = load_quant_config(source, field).rotation
    if rotation is None or not rotation.residual:
        raise SpecftError(f"{field}: quant config {source!r} rotates no residual stream (no rotation.residual)")
    return _rebuilt(source, rotation, size, field)


def _rebuilt(quant_name: str, rotation, size: int, field: str) -> tuple[torch.Tensor, dict]:
    """R1 of a quant config's rotation block, rebuilt from its kind and seed."""
    from specft.quant.orthogonal import orthogonal

    return orthogonal(rotation.residual, size, rotation.seed, field), \
        {"quant": quant_name, "kind": rotation.residual, "seed": rotation.seed}


def _matrix_file(path: Path, size: int, field: str) -> torch.Tensor:
    if not path.is_file():
        raise SpecftError(f"{field}: no file {path}")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors' own error type, or an OS error: one line naming the file
        raise SpecftError(f"{field}: {path} is not a readable .safetensors file ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else 'unreadable'})") from None
    if len(tensors) != 1:
        raise SpecftError(f"{field}: {path} holds {len(tensors)} tensors ({', '.join(sorted(tensors)[:4])}); "
                          "give a file with the one matrix")
    (r,) = tensors.values()
    return _checked(r, size, str(path), field)


def _saved_matrix(folder: Path, field: str) -> torch.Tensor:
    """R1 as a rotating quantizer saved it beside its checkpoint (msModelSlim's QuaRot)."""
    from specft.quantized_checkpoints import detect_family
    from specft.quantized_checkpoints.msmodelslim import MsModelSlim, saved_rotation

    if not isinstance(detect_family(folder), MsModelSlim):
        raise SpecftError(f"{field}: {folder} is not a checkpoint that saves its rotation (msModelSlim QuaRot); "
                          "for others recover R1 with scripts/recover_rotation.py and give its .safetensors")
    return saved_rotation(folder)


def _checked(r: torch.Tensor, size: int, where: str, field: str) -> torch.Tensor:
    r = r.double()
    if r.shape != (size, size):
        raise SpecftError(f"{field}: {where} holds a {tuple(r.shape)} matrix; the draft's target is {size} wide")
    err = (r @ r.T - torch.eye(size, dtype=torch.float64)).abs().max().item()
    if err > ORTHOGONALITY_TOLERANCE:
        raise SpecftError(f"{field}: {where} is not orthogonal (max |R R^T - I| = {err:.2e})")
    return r


def served_rotation(cfg) -> tuple[torch.Tensor, dict]:
    """(R1 in float64, where it came from) for trainer.unrotate: ``target`` takes the quant
    config's rotation block or the checkpoint folder's saved matrix; anything else is a
    .safetensors file (or checkpoint folder) holding it."""
    size, source = cfg.model.hidden_size, cfg.trainer.unrotate
    rotation = getattr(cfg.quant, "rotation", None)
    rotated = (rotation is not None and rotation.residual) or cfg.quant.name == "checkpoint"
    if not rotated:  # folding an R1 the target lacks would rotate the draft out of the target's basis
        raise ConfigError(f"trainer.unrotate={source}: the target (quant={cfg.quant.name}) rotates no residual "
                          "stream, so its draft has nothing to unrotate; drop trainer.unrotate")
    if source != "target":
        # a checkpoint whose quantizer fused a rotation (SpinQuant) says nothing of it: its
        # R1, recovered by scripts/recover_rotation.py, comes as a file
        return rotation_matrix(source, size, "trainer.unrotate")
    if rotation is not None and rotation.residual:  # the composed config: overrides included
        return _rebuilt(cfg.quant.name, rotation, size, "trainer.unrotate")
    return rotation_matrix(str(cfg.model.path), size, "trainer.unrotate")  # quant=checkpoint


# The basis a draft reads its target's residual stream in, recorded in draft_config.json
# ("basis") so that every command that rotates a draft can refuse to rotate it twice.
ROTATED, UNROTATED, UNKNOWN = "rotated", "unrotated", "unknown"


def target_basis(quant, model_path: str | None) -> str:
    """ROTATED for a quant config with a residual rotation or a checkpoint that saved its
    R1 (msModelSlim's QuaRot); UNKNOWN for any other checkpoint (a quantizer may fuse a
    rotation without a word, as SpinQuant does); UNROTATED otherwise (16-bit, or a format
    emulated without one)."""
    rotation = getattr(quant, "rotation", None)
    if rotation is not None and rotation.residual:
        return ROTATED
    if quant.name != "checkpoint":
        return UNROTATED
    from specft.quantized_checkpoints import detect_family
    from specft.quantized_checkpoints.msmodelslim import MsModelSlim, rotation_file

    folder = Path(str(model_path)).expanduser()
    return ROTATED if isinstance(detect_family(folder), MsModelSlim) and rotation_file(folder) else UNKNOWN
