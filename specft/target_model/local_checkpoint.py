"""Checkpoints specft writes itself (tiny test models, the converted SmolLM2 GGUF), built
once into the specft home, whatever the number of processes that want them at once."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from specft.common.errors import SpecftError

log = logging.getLogger(__name__)
WAIT_S = 1800


def ensure_checkpoint_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """``out_dir`` holding what ``write(tmp)`` saves, published atomically (temp dir, then
    rename; a dir is complete when it has a config.json). Once a process group is up,
    transformers' save_pretrained writes weights and config on rank 0 only: the other
    ranks would publish a dir holding just the tokenizer, so they wait for rank 0's."""
    if (out_dir / "config.json").exists():
        return out_dir
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return _wait_for(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        write(tmp)
        if not (tmp / "config.json").exists():
            raise SpecftError(f"writing {out_dir.name} produced no config.json (a non-zero rank?)")
        if out_dir.exists() and not (out_dir / "config.json").exists():
            # Left incomplete by an older specft: only complete dirs are ever renamed in.
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            tmp.replace(out_dir)
        except OSError:  # another process published first: keep theirs
            if not (out_dir / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _wait_for(out_dir: Path) -> Path:
    log.info("waiting for rank 0 to write %s", out_dir)
    deadline = time.monotonic() + WAIT_S
    while not (out_dir / "config.json").exists():
        if time.monotonic() > deadline:
            raise SpecftError(f"rank 0 did not write {out_dir} within {WAIT_S} s; on several hosts, "
                              f"SPECFT_HOME must be on storage they share")
        time.sleep(0.5)
    return out_dir
