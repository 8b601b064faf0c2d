"""Recover the residual rotation R1 a quantizer folded into a checkpoint, from the
unrotated and rotated checkpoints' input embeddings (orthogonal Procrustes), and write it
for `specft fold-rotation --rotation R1.safetensors`.

    python scripts/recover_rotation.py BASE_DIR ROTATED_DIR OUT.safetensors

Prints the relative residual |E_base R - E_rot| / |E_rot| (the storage rounding when the
rotation is exact), whether the base embedding had to be centered first (llm-compressor's
SpinQuant centers it), and R's distance from orthogonality.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specft.export.rotation_fold import recover_rotation


def tensor(folder: Path, suffix: str) -> torch.Tensor | None:
    """The tensor named ...``suffix`` in a HF checkpoint folder (sharded or not), or None."""
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.endswith(suffix):
                    return f.get_tensor(key)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("rotated", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    embeddings = [tensor(folder, "embed_tokens.weight") for folder in (a.base, a.rotated)]
    if any(e is None for e in embeddings):
        raise SystemExit(f"error: no embed_tokens.weight in {a.base if embeddings[0] is None else a.rotated}")
    # Untied heads pin the direction a centered embedding leaves open.
    heads = [tensor(folder, "lm_head.weight") for folder in (a.base, a.rotated)]
    r, residual, centered = recover_rotation(*embeddings, *heads)
    save_file({"R1": r.contiguous()}, str(a.out))
    ortho = (r @ r.T - torch.eye(r.shape[0], dtype=torch.float64)).abs().max().item()
    print(json.dumps({"size": r.shape[0], "relative_residual": residual, "base_centered": centered,
                      "max_orthogonality_error": ortho, "heads_used": all(h is not None for h in heads),
                      "out": str(a.out)}))


if __name__ == "__main__":
    main()
