"""Is a finished cache still the cache that was written?

Every file a cache lists (shards, the target head, the token counts) is recorded at write
time with its size and SHA-256. Opening a cache checks that each is present with its
size (cheap: one stat per file) and hashes a few shards picked at random; ``specft info
--verify`` hashes them all. A damaged shard is named in one line, and ``specft cache``
(or ``specft train``) with the same settings drops it from the cache and rebuilds only it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from specft.errors import SpecftError

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


def find_damage(cache_dir: Path, manifest: dict, verify: bool = False, seed: int | None = None) -> list[Damage]:
    """Damaged files of a complete cache: every listed file's presence and size; the
    checksums of SAMPLED_ON_OPEN random shards (all shards and side files with ``verify``)."""
    shards = manifest.get("shards", [])
    picked = set(range(len(shards))) if verify else set(
        random.Random(seed).sample(range(len(shards)), min(SAMPLED_ON_OPEN, len(shards))))
    damage = [d for i, s in enumerate(shards) if (d := _check(cache_dir, s["file"], s, i in picked))]
    for name, record in (manifest.get("files") or {}).items():
        if d := _check(cache_dir, name, record, verify):
            damage.append(d)
    return damage


def require_intact(cache_dir: Path, manifest: dict) -> None:
    damage = find_damage(cache_dir, manifest)
    if damage:
        more = f" (and {len(damage) - 1} more files)" if len(damage) > 1 else ""
        raise SpecftError(damage[0].line(cache_dir) + more)
