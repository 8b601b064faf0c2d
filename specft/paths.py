"""Where specft keeps things it builds once: tiny models, converted GGUF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def specft_home() -> Path:
    return Path(os.environ.get("SPECFT_HOME", Path.home() / ".cache" / "specft")).expanduser()


def models_dir() -> Path:
    return specft_home() / "models"


def conf_dir() -> Path:
    """The Hydra config tree, shipped inside the package (conf/ at the repo root links here)."""
    return Path(__file__).resolve().parent / "conf"
