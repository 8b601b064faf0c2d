"""Checkpoints: ``checkpoints/step-{N:07d}/`` written atomically (a temporary folder,
then a rename), a ``latest`` pointer, keep-last-k, and a consolidated ``final`` draft.

Each step folder holds DeepSpeed's model/optimizer/scheduler states, every rank's RNG
state, the consolidated draft (draft.safetensors + draft_config.json) and the run's
resolved config.yaml, so eval and export never need DeepSpeed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from specft.cache.manifest import atomic_write_json
from specft.common.disk import disk_full_line, is_disk_full
from specft.common.errors import SpecftError
from specft.common.launch import barrier

log = logging.getLogger(__name__)
LATEST = "latest"


def step_tag(step: int) -> str:
    return f"step-{step:07d}"


def step_tags(ckpt_root: Path) -> list[str]:
    """Finished step checkpoints, newest first (each is renamed into place whole)."""
    return sorted((p.name for p in ckpt_root.glob("step-*") if p.is_dir()), reverse=True)


def latest_tag(ckpt_root: Path) -> str | None:
    """The tag ``latest`` names; the newest step checkpoint when the pointer is damaged."""
    path = ckpt_root / LATEST
    if not path.exists():
        return None
    try:
        tag = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        tag = ""
    if tag and "/" not in tag and (ckpt_root / tag).is_dir():
        return tag
    fallback = next(iter(step_tags(ckpt_root)), None)
    why = f"names {tag}, which is gone" if tag and "/" not in tag else f"is damaged ({tag[:40]!r})"
    if fallback is None:
        # Training from step 0 here would silently replace a run the user meant to continue.
        raise SpecftError(f"trainer.resume: {path} {why}, and no step checkpoint is left in {ckpt_root}, so the "
                          "run cannot resume; trainer.resume=false trains it again from step 0, or give "
                          "another run dir")
    log.warning("checkpoints: %s %s; resuming from the newest step checkpoint left, %s", path, why, fallback)
    return fallback


def consolidated_state(draft) -> dict[str, torch.Tensor]:
    """The full draft state dict on CPU; under ZeRO-3 parameters are partitioned across
    ranks and are gathered first (every rank must call this)."""
    params = [p for p in draft.parameters() if hasattr(p, "ds_id")]
    if params:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().cpu().clone().contiguous() for k, v in draft.state_dict().items()}
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}


def write_draft_files(folder: Path, draft, extra_config: dict, run_config_yaml: str,
                      state: dict[str, torch.Tensor] | None = None) -> None:
    state = consolidated_state(draft) if state is None else state
    save_file(state, str(folder / "draft.safetensors"))
    config = {**asdict(draft.config), **extra_config}
    (folder / "draft_config.json").write_text(json.dumps(config, indent=2))
    (folder / "config.yaml").write_text(run_config_yaml)


def save_checkpoint(engine, ckpt_root: Path, step: int, rank: int, world_size: int,
                    keep_last: int, extra_config: dict, run_config_yaml: str, served=None) -> Path:
    """``served``: state -> the state the draft files hold (trainer.unrotate folds it); the
    DeepSpeed state stays as trained."""
    try:
        return _save_checkpoint(engine, ckpt_root, step, rank, world_size, keep_last, extra_config,
                                run_config_yaml, served)
    except Exception as err:
        tmp_root = ckpt_root / f".tmp-{step_tag(step)}"
        full = is_disk_full(err) or (tmp_root.exists() and _nearly_full(ckpt_root))
        if rank == 0:
            shutil.rmtree(tmp_root, ignore_errors=True)  # a partial checkpoint only takes space
        if not full:
            raise
        kept = latest_tag(ckpt_root)
        raise SpecftError("checkpoints: " + disk_full_line(
            f"step {step}'s checkpoint in {ckpt_root}",
            f"the last complete checkpoint, {kept}, is kept" if kept else "no checkpoint was complete yet",
            "rerun the same command: it resumes from there")) from None


# torch.save and DeepSpeed report a full disk as "file write failed", without the OS
# error: less free space than this right after a failed write means the disk filled.
_FULL_BELOW_BYTES = 1 << 20


def _nearly_full(path: Path) -> bool:
    return shutil.disk_usage(path).free < _FULL_BELOW_BYTES


def _save_checkpoint(engine, ckpt_root: Path, step: int, rank: int, world_size: int,
                     keep_last: int, extra_config: dict, run_config_yaml: str, served=None) -> Path:
    tag = step_tag(step)
    tmp_root = ckpt_root / f".tmp-{tag}"
    if rank == 0 and tmp_root.exists():
        shutil.rmtree(tmp_root)
    barrier(world_size)
    engine.save_checkpoint(str(tmp_root), tag=tag, client_state={"step": step}, save_latest=False)
    folder = tmp_root / tag
    torch.save({"torch": torch.get_rng_state()}, folder / f"rng-r{rank:03d}.pt")
    state = consolidated_state(engine.module)  # collective under ZeRO-3
    barrier(world_size)
    final = ckpt_root / tag
    if rank == 0:
        write_draft_files(folder, engine.module, extra_config, run_config_yaml, served(state) if served else state)
        if final.exists():
            shutil.rmtree(final)
        os.replace(folder, final)
        shutil.rmtree(tmp_root, ignore_errors=True)
        (ckpt_root / LATEST).parent.mkdir(parents=True, exist_ok=True)
        _atomic_text(ckpt_root / LATEST, tag)
        _prune(ckpt_root, keep_last)
    barrier(world_size)
    return final


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(ckpt_root: Path, keep_last: int) -> None:
    steps = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(engine, ckpt_root: Path, tag: str, rank: int) -> int:
    """Restore model, optimizer, scheduler and RNG; return the number of finished steps."""
    _, client = engine.load_checkpoint(str(ckpt_root), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    rng = ckpt_root / tag / f"rng-r{rank:03d}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng)["torch"])
    return int(client["step"])


def save_final(ckpt_root: Path, draft, extra_config: dict, run_config_yaml: str,
               state: dict[str, torch.Tensor]) -> Path:
    tmp = ckpt_root / ".tmp-final"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_draft_files(tmp, draft, extra_config, run_config_yaml, state)
    final = ckpt_root / "final"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write_json(final / "done.json", {"complete": True})
    return final
