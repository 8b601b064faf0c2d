"""One model in every GGUF type people serve on small machines, made by llama.cpp's own tools:
the targets of scripts/bench_llamacpp.py's tables (docs/serving.md).

    make llamacpp
    python scripts/make_gguf_targets.py --model ~/.cache/specft/models/smollm2_135m --out ggufs \
        --types F16 Q8_0 Q6_K Q4_K_M Q4_0 Q3_K_M Q2_K MXFP4 IQ4_XS IQ3_S IQ2_XS

convert_hf_to_gguf.py writes OUT/<name>-F16.gguf (the 16-bit model; for SmolLM2 that is
its shipped Q4_1 GGUF, dequantized by specft), and llama-quantize makes each type from it:
MXFP4 as a dense model (every attention and FFN weight MXFP4 through --tensor-type, the
embedding Q8_0), the i-quants with a flat importance matrix (the 2- and 3-bit ones refuse
to run without one; no calibration data is claimed) and a Q8_0 token embedding (specft
refuses an IQ4_XS one). Tensors whose rows do not divide into a type's blocks fall back as
llama-quantize decides (SmolLM2's 576-wide inputs: Q5_0 for the K-quants, IQ4_NL for the
i-quants); every file's tensor types are printed and written to OUT/targets.json. A type
already made is kept.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

from specft.llamacpp.convert import flat_imatrix, hf_to_gguf, quantize
from specft.llamacpp.install import check_install, install_record

# name -> (llama-quantize type, --tensor-type overrides, needs an importance matrix)
RECIPES = {
    "Q8_0": ("Q8_0", {}, False), "Q6_K": ("Q6_K", {}, False), "Q4_K_M": ("Q4_K_M", {}, False),
    "Q4_0": ("Q4_0", {}, False), "Q3_K_M": ("Q3_K_M", {}, False), "Q2_K": ("Q2_K", {}, False),
    "MXFP4": ("Q8_0", {"attn": "mxfp4", "ffn": "mxfp4"}, False),
    "IQ4_XS": ("IQ4_XS", {"token_embd": "q8_0"}, False), "IQ3_S": ("IQ3_S", {"token_embd": "q8_0"}, True),
    "IQ3_XXS": ("IQ3_XXS", {"token_embd": "q8_0"}, True), "IQ2_XS": ("IQ2_XS", {"token_embd": "q8_0"}, True),
    "IQ2_S": ("IQ2_S", {"token_embd": "q8_0"}, True),
}


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="an HF checkpoint directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--types", nargs="+", default=["F16", *RECIPES], choices=["F16", *RECIPES])
    ap.add_argument("--name", default=None, help="file name stem (default: the model folder's name)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    root = check_install()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or args.model.expanduser().resolve().name
    f16 = args.out / f"{stem}-F16.gguf"
    if not f16.exists():
        hf_to_gguf(args.model.expanduser(), f16, "f16")
    imatrix = args.out / f"{stem}-flat-imatrix.gguf"
    made = {"F16": str(f16)}
    for kind in args.types:
        if kind == "F16":
            continue
        base, overrides, needs_imatrix = RECIPES[kind]
        out = args.out / f"{stem}-{kind}.gguf"
        if needs_imatrix and not imatrix.exists():
            flat_imatrix(f16, imatrix)
        if not out.exists():
            quantize(f16, out, base, threads=args.threads, tensor_types=overrides,
                     imatrix=imatrix if needs_imatrix else None)
        made[kind] = str(out)
    record = {"llama.cpp": install_record(root), "model": str(args.model), "recipes": RECIPES,
              "targets": {k: {"path": p, "size_mb": round(Path(p).stat().st_size / 1e6, 1),
                              "tensor_types": tensor_types(Path(p))} for k, p in made.items()}}
    (args.out / "targets.json").write_text(json.dumps(record, indent=1) + "\n")
    for kind, facts in record["targets"].items():
        print(f"{kind:8s} {facts['size_mb']:6.1f} MB  {facts['tensor_types']}")


if __name__ == "__main__":
    main()
