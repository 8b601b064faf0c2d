"""What every export writer shares: the checkpoint's facts beside its draft config, the
output folder checked before any work, and files written so a failed write leaves the old
ones whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from safetensors.torch import save_file

from specft.common.errors import SpecftError
from specft.common.paths import require_writable_dir
from specft.export.verifier import verifier_facts


def draft_meta(folder: Path, draft_config: dict) -> dict:
    """The checkpoint's draft_config.json (as load_draft read it) plus the target's depth
    from the run config beside it."""
    meta = dict(draft_config)
    run = yaml.safe_load((folder / "config.yaml").read_text()) if (folder / "config.yaml").exists() else {}
    meta["target_num_layers"] = (run.get("model") or {}).get("num_layers")
    meta["verifier"] = verifier_facts(folder, draft_config)
    return meta


def check_out_dir(out: Path, overwrite: bool) -> Path:
    """Refuse, before any work, an output that is a file, is not writable, or holds other
    files (unless ``overwrite``)."""
    require_writable_dir(out, "out_dir")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        names = sorted(p.name for p in out.iterdir())
        raise SpecftError(f"out_dir: {out} is not empty ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                          "give a new directory, or --overwrite to replace its export files")
    return out


def write_files_atomically(out: Path, tensors: dict, config: dict,
                           names: tuple[str, str] = ("model.safetensors", "config.json")) -> None:
    """The tensors and config as ``names``, each written beside its final name, then
    renamed (a failed write leaves the old files whole); readable by every user
    (safetensors writes 0600), as a server running as another user must read them."""
    tensors_name, config_name = names
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = {name: out / f".{name}.tmp" for name in names}
        save_file(tensors, str(tmp[tensors_name]), metadata={"format": "pt"})
        tmp[config_name].write_text(json.dumps(config, indent=2))
        for name, path in tmp.items():
            os.chmod(path, 0o644)
            os.replace(path, out / name)
    except OSError as err:
        raise SpecftError(f"out_dir: cannot write {out}: {err.strerror or err}") from None
