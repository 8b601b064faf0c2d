"""Load a trained draft from its checkpoint folder for decoding."""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from specft.common.errors import SpecftError, first_line
from specft.drafts import DRAFT_ARCHS, DraftHeadConfig

log = logging.getLogger(__name__)


def resolve_checkpoint(path: str | Path, field: str = "eval.drafts") -> Path:
    """A run dir, its checkpoints/ folder, its ``latest`` pointer, or a checkpoint folder
    itself. A run still training has no ``final`` yet: its newest step checkpoint (the one
    ``latest`` names) is taken, and the log says which."""
    p = Path(path).expanduser()
    for candidate in (p, p / "final", p / "checkpoints" / "final"):
        if _is_checkpoint(candidate):
            return candidate.resolve()
    for pointer in (p, p / "latest", p / "checkpoints" / "latest"):
        step = _pointed_step(pointer)
        if step is not None:
            log.info("%s: %s has no final checkpoint yet; taking %s (the latest step)", field, path, step)
            return step.resolve()
    raise SpecftError(f"{field}: no draft checkpoint (draft.safetensors + draft_config.json) at {path}")


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "draft.safetensors").is_file() and (folder / "draft_config.json").is_file()


def _pointed_step(pointer: Path) -> Path | None:
    """The step folder a training run's ``latest`` file names (one line: the tag)."""
    if pointer.name != "latest" or not pointer.is_file():
        return None
    try:
        tag = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    step = pointer.parent / tag
    return step if tag and "/" not in tag and _is_checkpoint(step) else None


def _read_checkpoint(folder: Path, field: str) -> tuple[dict, dict]:
    """(draft_config.json, tensors); a damaged file is one line naming it."""
    from safetensors import SafetensorError

    name = "draft_config.json"
    try:
        meta = json.loads((folder / name).read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        name = "draft.safetensors"
        return meta, load_file(str(folder / name))
    except (OSError, ValueError, SafetensorError) as err:
        raise SpecftError(f"{field}: {folder / name} is damaged or unreadable ({str(err).splitlines()[0]}); "
                          "re-export it from the run's checkpoints or train again") from None


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32, field: str = "eval.drafts"):
    """(draft module in eval mode, its draft_config.json as a dict)."""
    folder = resolve_checkpoint(path, field)
    meta, state = _read_checkpoint(folder, field)
    try:
        draft = _build(folder, meta, state, field)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as err:
        # a field of another type or size than training writes (a hand edit): the module
        # cannot be built from it (the fuzz suite found these, tests/test_fuzz.py)
        message = first_line(err)
        raise SpecftError(f"{field}: {folder / 'draft_config.json'} does not describe a draft specft builds "
                          f"({type(err).__name__}: {message}); re-export it from the run's checkpoints") from None
    return draft.to(dtype).eval(), meta


def _build(folder: Path, meta: dict, state: dict, field: str):
    """The draft module draft_config.json describes, with its weights."""
    try:
        c = DraftHeadConfig(**{f.name: meta[f.name] for f in fields(DraftHeadConfig) if f.name in meta})
    except TypeError as err:
        raise SpecftError(f"{field}: {folder / 'draft_config.json'} is incomplete ({err})") from None
    arch = meta.get("architecture", "eagle3")
    if arch not in DRAFT_ARCHS:
        raise SpecftError(f"{field}: {folder} holds an unknown architecture {arch!r}; "
                          f"allowed: {', '.join(DRAFT_ARCHS.names)}")
    draft = DRAFT_ARCHS.get(arch).empty(c)
    if meta.get("draft_quant"):
        from specft.drafts.qat import apply_draft_qat
        from specft.quant.config import load_quant_config

        apply_draft_qat(draft, load_quant_config(meta["draft_quant"], "draft_quant"))
    try:
        missing, unexpected = draft.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape than its config says
        raise SpecftError(f"{field}: {folder} does not match its config ({str(err).splitlines()[1].strip()})") \
            from None
    if missing or unexpected:
        raise SpecftError(f"{field}: {folder} does not match its config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    return draft


def share_target_embedding(draft, target) -> bool:
    """Give the draft the target's own input embedding, as serving engines do (vLLM and
    SGLang give an EAGLE-3 or MTP draft whose export carries no embedding the target's):
    the draft then adds only its own weights to memory. A draft of the target's width holds
    a frozen copy of the embedding it was trained with; where that copy differs from this
    target's (a rotated target), the target's is the one served, so it is the one measured.
    A draft with an embedding of its own (another width, learned) keeps it."""
    mine, theirs = getattr(draft, "embed_tokens", None), target.get_input_embeddings()
    if mine is None or mine is theirs or mine.weight.shape != theirs.weight.shape:
        return False
    if not torch.equal(mine.weight, theirs.weight.to(mine.weight.dtype)):
        log.warning("eval: a draft's copy of the embedding differs from this target's; it reads the target's, "
                    "as it would when served")
    draft.embed_tokens = theirs
    return True
