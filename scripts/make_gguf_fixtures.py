"""Tiny GGUF targets made by llama.cpp's own tools, with llama.cpp's own logits as the oracle,
for specft's `model.path=FILE.gguf quant=checkpoint` tests (tests/test_gguf_checkpoints.py).

    make llamacpp
    python scripts/make_gguf_fixtures.py --out tests/fixtures/checkpoints/tiny_qwen3_gguf [--types MXFP4 ...]

A random-weight Qwen3 (3 layers, width 256 so that every K-quant's 256-wide superblocks
fit, vocabulary 2048) is converted to F32 by llama.cpp's convert_hf_to_gguf.py, then
quantized by llama-quantize into each type below (TYPES). For each GGUF, specft-llama-probe runs
llama.cpp on fixed token sequences (all rows in one decode, flash attention on: the tiled
kernel prompt processing takes) and OUT/<type>/oracle.safetensors keeps its logits and
each layer's input for the last rows, and OUT/made.json the llama.cpp build. specft
computes nothing that goes into the oracle: its tiny builder writes the float checkpoint,
and llama.cpp does the rest.

The tiny tokenizer's pre-tokenizer is not one llama.cpp's converter knows (it recognizes
tokenizers by a hash of their output); the converter is run with its answer set to qwen2's.
That changes only how llama.cpp would split text, and the tests feed token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors.torch import save_file

from specft.llamacpp.convert import flat_imatrix, hf_to_gguf, quantize
from specft.llamacpp.install import check_install, install_record
from specft.llamacpp.probe import run_probe
from specft.target_model.tiny import build_tiny


@dataclass(frozen=True)
class Recipe:
    """How llama-quantize makes one fixture: its type, per-tensor overrides, and whether it
    needs an importance matrix (the 2- and 3-bit i-quants refuse to quantize without one)."""
    kind: str
    tensor_types: dict = field(default_factory=dict)
    imatrix: bool = False


# fixture name -> its recipe. Q8_0 (Q8_0 activations), Q4_1 (Q8_1 activations with block
# sums), Q4_K_M (Q4_K and Q6_K: Q8_K activations); MXFP4 as a dense model gets it (every
# attention and FFN weight MXFP4 through --tensor-type, the embedding and head Q8_0), NVFP4 the same way
# (Q8_0 activations), the i-quants (Q8_K activations).
TYPES = {
    "Q8_0": Recipe("Q8_0"), "Q4_1": Recipe("Q4_1"), "Q4_K_M": Recipe("Q4_K_M"),
    "MXFP4": Recipe("Q8_0", {"attn": "mxfp4", "ffn": "mxfp4"}),
    "NVFP4": Recipe("Q8_0", {"attn": "nvfp4", "ffn": "nvfp4"}),  # no NVFP4 ftype in llama-quantize 11434
    "IQ4_XS": Recipe("IQ4_XS", {"token_embd": "q8_0"}),  # specft refuses an IQ4_XS token embedding
    "IQ3_XXS": Recipe("IQ3_XXS", imatrix=True), "IQ3_S": Recipe("IQ3_S", imatrix=True),
    "IQ2_XS": Recipe("IQ2_XS", imatrix=True), "IQ2_S": Recipe("IQ2_S", imatrix=True),
}
SHAPE = dict(name="tiny_qwen3_gguf", family="qwen3", num_layers=3, hidden_size=256, intermediate_size=512,
             num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=2048, tie_word_embeddings=False,
             num_experts=0, experts_top_k=0)
SEQUENCES, LENGTH, KEPT_ROWS = 3, 80, 16  # 80 >= 64 rows: the tiled flash-attention kernel

def sequences(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, SHAPE["vocab_size"], (SEQUENCES, LENGTH), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES),
                        help="make only these (the others already in OUT are kept)")
    args = parser.parse_args()
    root = check_install()
    out = args.out.resolve()
    with tempfile.TemporaryDirectory(prefix="specft-gguf-fixture-") as tmp:
        f32 = Path(tmp) / "f32.gguf"
        hf_to_gguf(build_tiny(SimpleNamespace(**SHAPE), Path(tmp) / "hf"), f32, "f32", pre_tokenizer="qwen2")
        imatrix = flat_imatrix(f32, Path(tmp) / "imatrix.gguf")
        _quantize_and_probe(f32, out, args.threads, args.types, imatrix)
    made = out / "made.json"
    record = json.loads(made.read_text()) if made.exists() else {}
    builds = record.get("builds") or {}
    if "llama.cpp" in record:  # the build the earlier fixtures were made with
        builds.update({kind: record["llama.cpp"] for kind in record.get("types", [])})
    builds.update({kind: install_record(root) for kind in args.types})
    types = [kind for kind in TYPES if kind in builds]
    made.write_text(json.dumps({"builds": builds, "types": types,
                                "recipes": {k: vars(TYPES[k]) for k in types}, "shape": SHAPE,
                                "oracle": {"sequences": SEQUENCES, "length": LENGTH, "rows_kept": KEPT_ROWS,
                                           "ubatch": "all", "flash_attn": "on"}}, indent=1) + "\n")


def _quantize_and_probe(f32: Path, out: Path, threads: int, kinds: list[str], imatrix: Path) -> None:
    ids = sequences()
    for kind in kinds:
        recipe = TYPES[kind]
        folder = out / kind
        folder.mkdir(parents=True, exist_ok=True)
        gguf_file = quantize(f32, folder / f"tiny-{kind}.gguf", recipe.kind, threads=threads,
                             tensor_types=recipe.tensor_types, imatrix=imatrix if recipe.imatrix else None)
        probe = run_probe(gguf_file, ids.tolist(), layers=tuple(range(SHAPE["num_layers"])), ubatch=0,
                          flash_attn="on", threads=threads)
        logits = np.stack([rows[-KEPT_ROWS:] for rows in probe.logits])
        layer_inputs = np.stack([rows[-KEPT_ROWS:] for rows in probe.hidden])  # [seq, row, layer, width]
        save_file({"input_ids": ids, "logits": torch.from_numpy(logits),
                   "layer_inputs": torch.from_numpy(layer_inputs)}, str(folder / "oracle.safetensors"))
        print(f"{kind}: {gguf_file.stat().st_size / 1e6:.2f} MB, logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main()
