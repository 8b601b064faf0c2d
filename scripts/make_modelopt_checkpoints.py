"""NVIDIA ModelOpt checkpoints made by ModelOpt itself on this CPU, each with its oracle:
the outputs of ModelOpt's own quantized model (its fake-quant TensorQuantizers) before
export, for specft's quant=checkpoint tests. ModelOpt runs in a venv of its own:

    python -m venv /work/venv-modelopt && /work/venv-modelopt/bin/pip install torch==2.13.0 && \\
        /work/venv-modelopt/bin/pip install nvidia-modelopt==0.47.0 transformers accelerate requests
    /work/venv-modelopt/bin/python scripts/make_modelopt_checkpoints.py --model DIR --out OUT --algos fp8,nvfp4

Per algorithm (ModelOpt's FP8_DEFAULT_CFG: FP8 weights and static FP8 inputs per tensor;
NVFP4_DEFAULT_CFG: FP4 weights and inputs in groups of 16 under FP8 group scales and a
per-tensor scale), calibrated on 4 synthetic sequences: OUT/<algo>/ gets the HF export
(export_hf_checkpoint: hf_quant_config.json) and ``oracle.safetensors`` (prompt ids, every
decoder layer's output, the last 4 positions' logits, a greedy continuation); OUT/made.json
records the versions and times. Imports nothing from specft.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path

import torch
from oracle_outputs import oracle_outputs

# algorithm -> ModelOpt configs whose quantizer lists are joined (later entries win)
CONFIGS = {"fp8": ["FP8_DEFAULT_CFG"], "nvfp4": ["NVFP4_DEFAULT_CFG"],
           "fp8_kv": ["FP8_DEFAULT_CFG", "FP8_KV_CFG"], "nvfp4_kv": ["NVFP4_DEFAULT_CFG", "FP8_KV_CFG"]}


def joined_config(mtq, names: list[str]) -> dict:
    """One quantize config from several: the first's settings, every quantizer list in order."""
    import copy

    cfg = copy.deepcopy(getattr(mtq, names[0]))
    for name in names[1:]:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(getattr(mtq, name)["quant_cfg"])
    return cfg


def nvfp4_dequantized(target: Path) -> dict:
    """Every exported NVFP4 layer's weight as ModelOpt's NVFP4QTensor.dequantize makes it
    (``dequantized.<layer>``, float32) from the packed codes, ``weight_scale`` and
    ``weight_scale_2``."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors.torch import load_file

    raw = {}
    for f in sorted(target.glob("model*.safetensors")):
        raw.update(load_file(str(f)))
    out = {}
    for key in sorted(k for k in raw if k.endswith(".weight_scale_2")):
        layer = key[: -len(".weight_scale_2")]
        packed = raw[f"{layer}.weight"]
        shape = torch.Size((packed.shape[0], packed.shape[1] * 2))
        qtensor = NVFP4QTensor(shape, torch.float32, packed)
        out[f"dequantized.{layer}"] = qtensor.dequantize(torch.float32, scale=raw[f"{layer}.weight_scale"],
                                                         double_scale=raw[key], block_sizes={-1: 16}).contiguous()
    return out


def make(model_dir: Path, out: Path, algo: str) -> dict:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calib = torch.randint(0, model.config.vocab_size, (4, 32))

    def forward_loop(m):
        with torch.no_grad():
            m(calib)

    t0 = time.perf_counter()
    model = mtq.quantize(model, joined_config(mtq, CONFIGS[algo]), forward_loop)
    seconds = time.perf_counter() - t0
    # NVFP4's quantized forward needs CUDA ("amax must be a CUDA tensor for dynamic block
    # quantization"): its oracle is ModelOpt's own dequantization of the exported weights
    oracle = oracle_outputs(model, tokenizer) if not algo.startswith("nvfp4") else None
    target = out / algo
    export_hf_checkpoint(model, export_dir=target)
    tokenizer.save_pretrained(target)
    if oracle is None:
        oracle = nvfp4_dequantized(target)
    save_file(oracle, str(target / "oracle.safetensors"))
    return {"algo": algo, "config": " + ".join(CONFIGS[algo]), "seconds": round(seconds, 1),
            "hf_quant_config": json.loads((target / "hf_quant_config.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--algos", default="fp8,nvfp4")
    args = ap.parse_args()
    algos = [a for a in args.algos.split(",") if a]
    unknown = [a for a in algos if a not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: --algos: unknown {unknown[0]!r}; allowed: {', '.join(CONFIGS)}")
    tools = {"nvidia-modelopt": version("nvidia-modelopt"), "torch": version("torch"),
             "transformers": version("transformers")}
    # checkpoints made in earlier runs stay listed (each with the tools that made it)
    record = args.out / "made.json"
    made = json.loads(record.read_text()) if record.is_file() else {"tool": tools, "model": str(args.model),
                                                                    "checkpoints": []}
    for algo in algos:
        entry = {**make(args.model, args.out, algo), "tools": tools}
        made["checkpoints"] = [c for c in made["checkpoints"] if c["algo"] != algo] + [entry]
        print(f"{algo}: {entry['seconds']} s -> {args.out / algo}")
    record.write_text(json.dumps(made, indent=2) + "\n")


if __name__ == "__main__":
    main()
