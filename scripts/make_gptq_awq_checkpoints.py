"""GPTQ and AWQ checkpoints made by the real tools on this CPU, with GPTQModel's own CPU
forward as their oracle, for specft's quant=checkpoint tests. Each tool runs in a venv of
its own (their pins clash with specft's and with each other's):

    python -m venv /work/venvs/autoround && /work/venvs/autoround/bin/pip install torch==2.13.0 && \\
        /work/venvs/autoround/bin/pip install auto-round==0.16.1
    python -m venv /work/venvs/gptqmodel && /work/venvs/gptqmodel/bin/pip install torch==2.13.0 && \\
        /work/venvs/gptqmodel/bin/pip install gptqmodel==7.7.0        # pulls its own torch
    /work/venvs/autoround/bin/python scripts/make_gptq_awq_checkpoints.py make --tool autoround --model DIR --out OUT
    GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptqmodel/bin/python scripts/make_gptq_awq_checkpoints.py make \\
        --tool gptqmodel --model DIR --out OUT
    GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptqmodel/bin/python scripts/make_gptq_awq_checkpoints.py oracle OUT/*

- AutoRound 0.16 (its signed-gradient rounding, 20 iterations, 16 calibration samples):
  OUT/gptq_autoround (``auto_gptq`` export: GPTQ v1, 4 bit, group 32, symmetric) and
  OUT/awq_autoround (``auto_awq`` export: AWQ GEMM, 4 bit, group 32, zero points).
- GPTQModel 7.7 (GPTQ with act-order): OUT/gptq_actorder (GPTQ v1, 4 bit, group 32,
  symmetric, ``desc_act`` with its ``g_idx``); with ``--moe-model`` (tiny Qwen3-MoE) also
  OUT/gptq_moe (the same without act-order: every expert's projections quantized apart). (GPTQModel's own AWQ needs output widths in
  multiples of 64; tiny Qwen3's k/v projections are 32 wide.)
- AutoAWQ 0.2.9 (its own venv, with transformers < 4.52): OUT/awq_autoawq (AWQ GEMM, 4 bit,
  group 32, zero points; ``apply_clip=False``, see make_autoawq) with its oracle (its own
  ``dequantize_gemm``) written beside it; ``oracle`` below leaves it alone.

    python -m venv /work/venvs/autoawq && /work/venvs/autoawq/bin/pip install torch==2.13.0 && \\
        /work/venvs/autoawq/bin/pip install autoawq==0.2.9 'transformers>=4.51,<4.52'
    /work/venvs/autoawq/bin/python scripts/make_gptq_awq_checkpoints.py make --tool autoawq --model DIR --out OUT

- ``oracle``: each checkpoint loaded by GPTQModel with its torch kernels (BACKEND.TORCH,
  float16, the only activation dtype its GPTQ torch kernel takes); OUT/<name>/oracle.safetensors gets scripts/oracle_outputs.py's
  outputs and every quantized layer's weight as GPTQModel dequantizes it
  (``dequantized.<layer>``, [out, in]).

Calibration: the first 64 GSM8K training problems (question and answer). OUT/made.json
records the tools' versions and times. Imports nothing from specft.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path

import torch

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
BITS, GROUP = 4, 32


def calibration(path: Path, n: int = 64) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [r["question"] + " " + r["answer"] for r in rows]


def make_autoround(model_dir: Path, out: Path, texts: list[str], group: int = GROUP) -> list[dict]:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = []
    for name, fmt, sym in (("gptq_autoround", "auto_gptq", True), ("awq_autoround", "auto_awq", False)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        t0 = time.perf_counter()
        rounder = AutoRound(model, tokenizer, bits=BITS, group_size=group, sym=sym, iters=20, nsamples=16,
                            seqlen=64, dataset=texts, device_map="cpu")
        staging = out / f".{name}"
        rounder.quantize_and_save(str(staging), format=fmt)
        (written,) = [p for p in staging.iterdir() if (p / "config.json").is_file()]  # it adds a subfolder
        written.rename(out / name)
        staging.rmdir()
        made.append({"name": name, "tool": "auto-round", "format": fmt, "sym": sym,
                     "group_size": group, "seconds": round(time.perf_counter() - t0, 1)})
    return made


def make_gptqmodel(model_dir: Path, out: Path, texts: list[str], moe_model: Path | None = None,
                   group: int = GROUP) -> list[dict]:
    from gptqmodel import GPTQModel, QuantizeConfig

    made = []
    for name, source, desc_act in (("gptq_actorder", model_dir, True), ("gptq_moe", moe_model, False)):
        if source is None:
            continue
        t0 = time.perf_counter()
        config = QuantizeConfig(bits=BITS, group_size=group, desc_act=desc_act, sym=True)
        model = GPTQModel.load(str(source), config, device="cpu")
        model.quantize(texts, batch_size=4)
        model.save(str(out / name))
        made.append({"name": name, "tool": "gptqmodel", "format": "gptq", "desc_act": desc_act, "group_size": group,
                     "model": str(source),
                     "seconds": round(time.perf_counter() - t0, 1)})
    return made


def make_autoawq(model_dir: Path, out: Path, texts: list[str], group: int = GROUP) -> list[dict]:
    """AutoAWQ 0.2.9 (transformers < 4.52 in its venv) on this CPU. Its clipping search
    needs output widths in multiples of 64 (tiny Qwen3's k/v projections are 32), so
    apply_clip=False: the scale search alone. Its oracle is its own dequantize_gemm of the
    saved weights (``dequantized.<layer>``); its forward is not run here."""
    import shutil

    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    model = AutoAWQForCausalLM.from_pretrained(str(model_dir), device_map="cpu")
    # a tokenizer saved by transformers 5 names a class 4.51 lacks: read its tokenizer.json
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    model.quantize(tokenizer, quant_config={"zero_point": True, "q_group_size": group, "w_bit": BITS,
                                            "version": "GEMM"},
                   calib_data=texts, max_calib_seq_len=512, n_parallel_calib_samples=4, apply_clip=False)
    target = out / "awq_autoawq"
    model.save_quantized(str(target))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, target / name)
    raw = load_file(str(target / "model.safetensors"))
    oracle = {f"dequantized.{k[:-len('.qweight')]}": dequantize_gemm(
        raw[k], raw[k.replace("qweight", "qzeros")], raw[k.replace("qweight", "scales")], BITS, group).t().contiguous()
        for k in raw if k.endswith(".qweight")}
    save_file(oracle, str(target / "oracle.safetensors"), metadata={"autoawq": version("autoawq"),
                                                                   "oracle": "dequantize_gemm"})
    return [{"name": "awq_autoawq", "tool": "autoawq", "format": "awq gemm", "apply_clip": False, "group_size": group,
             "seconds": round(time.perf_counter() - t0, 1)}]


@torch.no_grad()
def oracle(model_dir: Path) -> None:
    from gptqmodel import BACKEND, GPTQModel
    from oracle_outputs import oracle_outputs
    from safetensors.torch import save_file

    # float16: GPTQModel's torch GPTQ kernel runs 16-bit activations only, as GPTQ is served
    loaded = GPTQModel.load(str(model_dir), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    model = loaded.model.eval()
    out = oracle_outputs(model, loaded.tokenizer)
    kernels = set()
    for name, module in model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        if hasattr(module, "dequantize_weight"):  # GPTQ's TorchLinear: [in, out]
            weight = module.dequantize_weight()
        else:  # AWQ's AwqTorchLinear: its forward's own dequantization, [in, out]
            from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

            weight = dequantize_gemm(qweight=module.qweight, qzeros=module.qzeros, scales=module.scales,
                                     bits=module.bits, group_size=module.group_size)
        out[f"dequantized.{name}"] = weight.t().contiguous()
        kernels.add(type(module).__name__)
    save_file({k: v.contiguous() for k, v in out.items()}, str(model_dir / "oracle.safetensors"),
              metadata={"dtype": "float16", "gptqmodel": version("gptqmodel"), "kernels": ",".join(sorted(kernels))})
    print(f"{model_dir}: oracle from GPTQModel {sorted(kernels)} ({sum(k.startswith('dequantized.') for k in out)} layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--tool", choices=("autoround", "gptqmodel", "autoawq"), required=True)
    mk.add_argument("--model", type=Path, required=True)
    mk.add_argument("--out", type=Path, required=True)
    mk.add_argument("--calibration", type=Path, default=GSM8K)
    mk.add_argument("--moe-model", type=Path, help="gptqmodel: also OUT/gptq_moe from this Qwen3-MoE checkpoint")
    mk.add_argument("--group", type=int, default=GROUP, help="weights per scale (SmolLM2's 576-wide inputs take "
                    "32 or 64, not 128)")
    orc = sub.add_parser("oracle")
    orc.add_argument("dirs", nargs="+", type=Path)
    args = ap.parse_args()
    if args.command == "oracle":
        for d in args.dirs:
            if (d / "config.json").is_file() and d.name != "awq_autoawq":  # AutoAWQ's oracle is its own
                oracle(d)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    texts = calibration(args.calibration)
    package = {"autoround": "auto-round", "gptqmodel": "gptqmodel", "autoawq": "autoawq"}[args.tool]
    if args.tool == "gptqmodel":
        rows = make_gptqmodel(args.model, args.out, texts, args.moe_model, args.group)
    elif args.tool == "autoawq":
        rows = make_autoawq(args.model, args.out, texts, args.group)
    else:
        rows = make_autoround(args.model, args.out, texts, args.group)
    made_path = args.out / "made.json"
    made = json.loads(made_path.read_text()) if made_path.is_file() else {"checkpoints": []}
    made["model"], made["calibration"] = str(args.model), f"{args.calibration} (first 64 problems)"
    made.setdefault("tools", {})[package] = {package: version(package), "torch": version("torch"),
                                             "transformers": version("transformers")}
    made["checkpoints"] = [c for c in made["checkpoints"] if c["name"] not in {r["name"] for r in rows}] + rows
    made_path.write_text(json.dumps(made, indent=2) + "\n")
    for r in rows:
        print(f"{r['name']}: {r['seconds']} s -> {args.out / r['name']}")


if __name__ == "__main__":
    main()
