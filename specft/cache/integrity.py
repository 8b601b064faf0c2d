"""Is a finished cache still the cache that was written?

Every file a cache lists (shards, the target head, the token counts) is recorded at write
time with its size and SHA-256. Opening a cache checks that each is present with its
size (cheap: one stat per file); every `specft train` start also hashes a few shards
picked at random, and `specft cache` and ``specft info --verify`` hash them all. A damaged
shard is named in one line, and ``specft cache``
(or ``specft train``) with the same settings drops it from the cache and rebuilds only it.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from specft.cache.manifest import MANIFEST, atomic_write_json, read_json
from specft.common.errors import SpecftError

log = logging.getLogger(__name__)

SAMPLED_ON_OPEN = 2  # shards hashed on every open (all with --verify)
_CHUNK = 1 << 22


def file_record(path: Path) -> dict:
    """What is recorded for a written file: its size and SHA-256."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


@dataclass
class Damage:
    file: str
    why: str

    def line(self, cache_dir: Path) -> str:
        return (f"cache: {cache_dir / self.file} is damaged ({self.why}); rerun `specft cache` (or `specft train`) "
                "with the same settings to rebuild the damaged files only")


def _check(cache_dir: Path, file: str, record: dict, hash_it: bool) -> Damage | None:
    path = cache_dir / file
    if not path.is_file():
        return Damage(file, "missing")
    size = path.stat().st_size
    if "bytes" in record and size != record["bytes"]:
        return Damage(file, f"{size} bytes, {record['bytes']} were written")
    if hash_it and "sha256" in record and file_record(path)["sha256"] != record["sha256"]:
        return Damage(file, "its checksum differs from the one recorded when it was written")
    return None


def find_damage(cache_dir: Path, manifest: dict, verify: bool = False, sample: int = SAMPLED_ON_OPEN) -> list[Damage]:
    """Damaged files of a complete cache: every listed file's presence and size; the
    checksums of ``sample`` random shards (all shards and side files with ``verify``)."""
    shards = manifest.get("shards", [])
    picked = set(range(len(shards))) if verify else set(
        random.sample(range(len(shards)), min(sample, len(shards))))
    damage = [d for i, s in enumerate(shards) if (d := _check(cache_dir, s["file"], s, i in picked))]
    for name, record in (manifest.get("files") or {}).items():
        if d := _check(cache_dir, name, record, verify):
            damage.append(d)
    return damage


def drop_damaged(cache_dir: Path, verify: bool = False) -> list[str]:
    """Before a cache is reused (rank 0 only): find what is damaged in a complete cache
    (or an unreadable manifest / progress file) and forget it, so that the build that
    follows redoes only that: damaged shards leave their rank's progress file and the
    disk, damaged side files are deleted (they are rebuilt at the end of every build),
    and the manifest goes (it is merged again). Returns the damaged names."""
    manifest_path = cache_dir / MANIFEST
    bad = []
    progress_files = {}
    for progress in sorted(cache_dir.glob("progress-r*.json")):
        try:
            progress_files[progress] = read_json(progress)
        except SpecftError:
            bad.append(progress.name)
            progress.unlink()  # its rank's shards are redone
    if not manifest_path.exists():
        return bad
    try:
        manifest = read_json(manifest_path)
        damage = find_damage(cache_dir, manifest, verify) if manifest.get("complete") else []
    except SpecftError:
        damage = []
        bad.append(MANIFEST)
    for d in damage:
        log.warning("cache: %s is damaged (%s)", cache_dir / d.file, d.why)
        bad.append(d.file)
    if not bad:
        return bad
    shard_names = {d.file for d in damage}
    for progress, state in progress_files.items():
        kept = [s for s in state["shards"] if s["file"] not in shard_names]
        if len(kept) != len(state["shards"]):
            atomic_write_json(progress, {**state, "shards": kept})
    for name in bad:
        (cache_dir / name).unlink(missing_ok=True)
    manifest_path.unlink(missing_ok=True)
    log.warning("cache: %d damaged file(s) in %s (%s); rebuilding only those", len(bad), cache_dir, ", ".join(bad))
    return bad


def require_intact(cache_dir: Path, manifest: dict) -> None:
    """Every listed file present with its recorded size (one stat each): the check for
    every open of a cache. Checksums are the job of drop_damaged, which each `specft
    cache` / `specft train` start runs first, and of `specft info --verify`."""
    damage = find_damage(cache_dir, manifest, sample=0)
    if damage:
        more = f" (and {len(damage) - 1} more files)" if len(damage) > 1 else ""
        raise SpecftError(damage[0].line(cache_dir) + more)
