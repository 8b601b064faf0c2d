"""A Hugging Face fine-grained FP8 checkpoint (``quant_method: fp8``, the format of Qwen's
own Qwen3-*-FP8 releases) made from an llm-compressor FP8_BLOCK checkpoint.

No tool writes the HF FP8 format on a CPU (transformers' FineGrainedFP8 quantizer needs a
GPU), but its arithmetic is compressed-tensors' FP8_BLOCK scheme: E4M3 weights with one
float32 scale per block, dynamic FP8 inputs per token in groups of the block's width. So
the same tensors are renamed: ``weight_scale`` -> ``weight_scale_inv`` (HF's name for
the same multiplier), and config.json's ``quantization_config`` becomes HF's, with
``weight_block_size`` the source's block and the unquantized modules listed in
``modules_to_not_convert``. Imports nothing from specft.

    python scripts/make_hf_fp8_fixture.py --source tests/fixtures/checkpoints/tiny_qwen3/fp8_block \\
        --out tests/fixtures/checkpoints/tiny_qwen3_hf_fp8
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

# oracle.safetensors: the producing library's outputs, when the source has them (the same
# tensors, so the same model)
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "oracle.safetensors")


def not_converted(ignore: list[str], tensor_names) -> list[str]:
    """compressed-tensors' ignore list as HF's modules_to_not_convert, which takes module
    names: a ``re:`` pattern becomes every module of the checkpoint it matches (a
    Mixture-of-Experts router: ``re:.*mlp.gate$``)."""
    modules = sorted({k.rsplit(".", 1)[0] for k in tensor_names})
    out = []
    for entry in ignore:
        if entry.startswith("re:"):
            out += [m for m in modules if re.match(entry[3:], m)]
        else:
            out.append(entry)
    return out


def hf_quantization_config(source: dict, tensor_names) -> dict:
    (group,) = source["config_groups"].values()
    weights, inputs = group["weights"], group["input_activations"]
    if weights["strategy"] != "block" or not inputs or not inputs["dynamic"] or inputs["strategy"] != "group" \
            or inputs["group_size"] != weights["block_structure"][1]:
        raise SystemExit("error: --source: not an FP8_BLOCK checkpoint (block weights, dynamic group inputs)")
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(weights["block_structure"]),
            "modules_to_not_convert": not_converted(source["ignore"], tensor_names)}


def convert(source: Path, out: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    tensors = {(k[: -len("weight_scale")] + "weight_scale_inv" if k.endswith(".weight_scale") else k): v
               for k, v in load_file(str(source / "model.safetensors")).items()}
    config["quantization_config"] = hf_quantization_config(config["quantization_config"], tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    (out / "made.json").write_text(json.dumps({"source": str(source), "by": "scripts/make_hf_fp8_fixture.py",
                                               "renamed": {"weight_scale": "weight_scale_inv"}}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    convert(args.source, args.out)
    print(f"{args.source} -> {args.out}")


if __name__ == "__main__":
    main()
