"""Where specft keeps things it builds once: tiny models, converted GGUF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def specft_home() -> Path:
    value = os.environ.get("SPECFT_HOME")
    if value is not None and not value.strip():
        # Path('') is the working directory: models would be built wherever a command runs.
        from specft.common.errors import SpecftError

        raise SpecftError("SPECFT_HOME: set but empty; unset it (default ~/.cache/specft) or give a directory")
    return Path(value or Path.home() / ".cache" / "specft").expanduser()


def models_dir() -> Path:
    return specft_home() / "models"


def conf_dir() -> Path:
    """The Hydra config tree, shipped inside the package (conf/ at the repo root links here)."""
    return Path(__file__).resolve().parent.parent / "conf"


def require_writable_dir(path: str | Path, field: str) -> Path:
    """``path`` is, or can be made, a directory this process writes into: one line naming
    ``field`` otherwise. Checked before a command writes anything; nothing is created."""
    import os

    from specft.common.errors import SpecftError

    p = Path(path).expanduser()
    existing = next((q for q in (p, *p.parents) if q.exists()), None)
    if existing is None:
        raise SpecftError(f"{field}: {p} has no existing parent directory")
    if not existing.is_dir():
        raise SpecftError(f"{field}: {existing} is a file, so {p} cannot be a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecftError(f"{field}: {existing} is not writable")
    return p
