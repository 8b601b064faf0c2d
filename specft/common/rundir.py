"""A run directory's config.yaml: checked before anything is written, written atomically.

A command that is refused must leave a finished run as it was, and a resumed run must be
the run its checkpoints came from: resuming with settings that change the draft (its
shape, TTT steps, loss, data, target) would silently train a different draft on top of
the old one. Only the fields in RESUME_SAFE may differ from the stored config.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from specft.common.errors import SpecftError
from specft.common.nested import flatten

# Prefixes (whole groups) and fields that may change between a run and its resumption:
# where and how long it runs, how it logs and evaluates; nothing that changes the draft.
RESUME_SAFE = (
    "meta", "run_dir", "eval", "logger", "plan",
    "trainer.max_steps", "trainer.save_every", "trainer.keep_last", "trainer.log_every",
    "trainer.val_every", "trainer.val_batches", "trainer.val_samples", "trainer.resume", "trainer.nproc",
    "trainer.hostfile",
    "trainer.num_nodes", "trainer.node_rank", "trainer.master_addr", "trainer.master_port",
    "trainer.rendezvous_timeout_s", "cache.root", "cache.dir", "cache.batch_size", "cache.sharding", "cache.tp_size",
)


def _safe(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in RESUME_SAFE)


def resume_conflicts(stored: dict, current: dict) -> list[str]:
    """Fields set in both configs whose values differ and that resuming cannot change."""
    a, b = flatten(stored), flatten(current)
    return [f"{k}: the run has {a[k]!r}, this command has {b[k]!r}"
            for k in sorted(set(a) & set(b)) if a[k] != b[k] and not _safe(k)]


def check_resume(run_dir: Path, current: dict) -> None:
    """Refuse to resume a run with checkpoints under settings that change its draft."""
    path = run_dir / "config.yaml"
    checkpoints = run_dir / "checkpoints"
    if not (current.get("trainer") or {}).get("resume", True) or not path.is_file():
        return
    if not checkpoints.is_dir() or not any(checkpoints.iterdir()):
        return
    stored = read_stored_config(path)
    if stored is None:
        raise SpecftError(f"run_dir: {path} is damaged; the run's checkpoints cannot be matched to a config "
                          "(give another run dir, or trainer.resume=false to train from scratch there)")
    conflicts = resume_conflicts(stored, current)
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise SpecftError(f"trainer.resume: {run_dir} was trained with other settings: {conflicts[0]}{more}; "
                          "resuming may change only where and how long it runs (e.g. trainer.max_steps); "
                          "use another run dir (hydra.run.dir=...) or trainer.resume=false")


def read_stored_config(path: Path) -> dict | None:
    """A run's config.yaml as a dict; None when it is missing or damaged."""
    try:
        stored = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return stored if isinstance(stored, dict) else None


def same_run_config(path: Path, current: dict) -> bool:
    """True when ``path`` holds this config already, ``meta`` (git SHA, argv) aside."""
    stored = read_stored_config(path)
    if stored is None:
        return False
    strip = lambda c: {k: v for k, v in c.items() if k != "meta"}  # noqa: E731
    return strip(stored) == strip(current)


def write_atomic(path: Path, text: str) -> None:
    """Write beside the final name, then rename: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# What a command writes before its work starts: its config, its locks. A folder holding
# nothing else was only set up for the work.
# Files that say what a folder is for but hold no result: a run's config, a cache's
# answer key (data/answer_store.py) before any answer is stored.
SCAFFOLDING_NAMES = ("config.yaml", "answer_key.json")


def _only_scaffolding(folder: Path, empty_files: bool = False) -> bool:
    """Nothing in ``folder`` but its scaffolding, locks and hidden files; ``empty_files``:
    and empty files (a metrics.jsonl the refused command opened before its first step;
    never counted in a folder that existed before the command, where one may be the user's)."""
    return all(p.is_dir() or p.name in SCAFFOLDING_NAMES or p.name.endswith(".lock") or p.name.startswith(".")
               or (empty_files and p.stat().st_size == 0) for p in folder.rglob("*"))


class RefusalUndo:
    """What a refused command (SpecftError) set up is undone, so that it changes nothing
    that existed: a run config it replaced is put back, and the folders that were bare
    before it (absent, or made empty by Hydra for the run) and hold nothing but its config
    and locks after are removed. Refusals met after the ranks start (a checkpoint missing
    a tensor, a resume the checkpoint cannot take) come after the run config and the cache
    folders were made."""

    def __init__(self, run_dir: Path, roots: list[Path]):
        self.config = run_dir / "config.yaml"
        self.old_config = self.config.read_text(encoding="utf-8") if self.config.is_file() else None
        bare = [run_dir] if self.old_config is None and _bare(run_dir) else []
        self.bare = bare + [root for root in roots if _bare(root)]
        self.before = {root: set(root.iterdir()) if root.is_dir() else set() for root in roots}

    def undo(self) -> None:
        if self.old_config is not None:
            write_atomic(self.config, self.old_config)
        self.remove_bare_folders()

    def remove_bare_folders(self) -> None:
        """Also after a command that writes elsewhere (eval with eval.out_dir), so that the
        run folder Hydra made for it does not stay behind empty."""
        new = [p for root, before in self.before.items() if root.is_dir() for p in root.iterdir()
               if p.is_dir() and p not in before]
        for folder in [*new, *self.bare]:  # children before the folders they are in
            if folder.is_dir() and _only_scaffolding(folder, empty_files=True):
                shutil.rmtree(folder, ignore_errors=True)


def _bare(folder: Path) -> bool:
    return not folder.exists() or (folder.is_dir() and _only_scaffolding(folder))
