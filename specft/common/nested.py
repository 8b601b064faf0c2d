"""Nested dicts (configs, provenance) as flat dotted keys, for comparing field by field."""

from __future__ import annotations

from typing import Any


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; a non-dict is one entry under ``prefix``."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
