"""The cache manifest: what a cache holds and the provenance it was built from.

The provenance is every input that changes the cached numbers (model, quant config,
layer ids, tokenizer, data selection, storage dtype, cache version). Its hash names the
cache directory; a cache built from different inputs is refused, naming the field.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from specft.common.errors import SpecftError
from specft.common.nested import flatten

MANIFEST = "manifest.json"


def atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """A JSON file of the cache; one line naming it when it is unreadable or not JSON text."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8 text at all
        raise SpecftError(f"cache: cannot read {path}: {str(err).splitlines()[0][:200]}") from None


def provenance_diff(stored: dict, current: dict) -> list[str]:
    a, b = flatten(stored), flatten(current)
    return [f"{k}: cache has {a.get(k)!r}, this run has {b.get(k)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def check_provenance(cache_dir: Path, stored: dict, current: dict) -> None:
    diff = provenance_diff(stored, current)
    if diff:
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        raise SpecftError(f"cache at {cache_dir} was built from different inputs: {diff[0]}{more}; "
                          f"use another cache.dir or delete it")
