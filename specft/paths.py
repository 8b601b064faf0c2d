"""Where specft keeps things it builds once: tiny models, converted GGUF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def specft_home() -> Path:
    return Path(os.environ.get("SPECFT_HOME", Path.home() / ".cache" / "specft")).expanduser()


def models_dir() -> Path:
    return specft_home() / "models"


def conf_dir() -> Path:
    """conf/ at the repo root in a checkout; the packaged copy (specft.conf) when installed."""
    import importlib.util

    spec = importlib.util.find_spec("specft.conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parent.parent / "conf"
