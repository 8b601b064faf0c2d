"""Quantized checkpoints made by the real tool (llm-compressor), for specft's
`quant=checkpoint` tests and benchmarks.

llm-compressor pins its own transformers and compressed-tensors, so it runs in a venv of
its own, never in specft's (docs/checkpoints.md):

    python -m venv .venv-quant && .venv-quant/bin/pip install torch==2.13.0 && \
        .venv-quant/bin/pip install llmcompressor==0.14.0.1
    .venv-quant/bin/python scripts/make_checkpoints.py --model DIR --out OUT \
        --schemes fp8_dynamic,w8a8_int8_sq_gptq,w4a16_g32_gptq

A scheme with run-time transforms (w8a8_int8_spinquant) also gets OUT/<scheme>/oracle.safetensors:
what llm-compressor's own in-memory model computed (scripts/oracle_outputs.py).

DIR is a plain Hugging Face checkpoint (tiny Qwen3: `$SPECFT_HOME/models/tiny_qwen3-*`;
SmolLM2: the converted copy `$SPECFT_HOME/models/smollm2_135m`). Each scheme goes to
OUT/<scheme>/ with the tokenizer, and OUT/made.json records the tool versions, the
recipes and the calibration data. The script imports nothing from specft.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _scheme(weights: dict, activations: dict | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                              input_activations=QuantizationArgs(**activations) if activations else None)


# scheme name -> (modifiers(factory), needs calibration data). Group sizes divide both
# tiny Qwen3's widths (64, 128) and SmolLM2's (576, 1536); the presets' 128 do not.
def _recipes():
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from llmcompressor.modifiers.transform import SpinQuantModifier

    ignore = ["lm_head", "re:.*mlp.gate$"]  # the head, and a Mixture-of-Experts router
    int8_token = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    int8_tensor_static = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
    int8_channel = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    return {
        # data-free: FP8 weights per channel, FP8 activations per token at run time
        "fp8_dynamic": (lambda: [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore)], False),
        # FP8 weights per tensor, static per-tensor FP8 activation scales from calibration
        "fp8_static": (lambda: [QuantizationModifier(targets="Linear", scheme="FP8", ignore=ignore)], True),
        # FP8 weights in blocks, dynamic FP8 activations per group (the FP8_BLOCK preset, the
        # DeepSeek-V3 / Qwen3-FP8 layout, with 32 for its 128, which tiny widths cannot group)
        "fp8_block": (lambda: [QuantizationModifier(config_groups={"group_0": _scheme(
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [32, 32]},
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
             "dynamic": True})}, ignore=ignore)], False),
        # SmoothQuant, then GPTQ: INT8 weights per channel, dynamic INT8 activations per token
        "w8a8_int8_sq_gptq": (lambda: [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(config_groups={"group_0": _scheme(int8_channel, int8_token)}, ignore=ignore)], True),
        # as above with a static per-tensor activation scale
        "w8a8_int8_static_gptq": (lambda: [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(config_groups={"group_0": _scheme(int8_channel, int8_tensor_static)}, ignore=ignore)], True),
        # GPTQ INT4 weights in groups of 32 with a zero point (pack-quantized), 16-bit activations
        "w4a16_g32_gptq": (lambda: [GPTQModifier(config_groups={"group_0": _scheme(
            {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32})},
            ignore=ignore)], True),
        # RTN INT8 weights in groups of 32, symmetric (pack-quantized W8A16)
        "w8a16_g32": (lambda: [QuantizationModifier(config_groups={"group_0": _scheme(
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32})},
            ignore=ignore)], False),
        # FP4 (E2M1) weights in groups of 16 with FP8 scales under a global scale; FP4 inputs
        # with dynamic group scales under a calibrated global one (the NVFP4 preset)
        "nvfp4": (lambda: [QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore)], True),
        # the same weights, 16-bit inputs
        "nvfp4a16": (lambda: [QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=ignore)], False),
        # FP4 (E2M1) weights in groups of 32 with power-of-two (E8M0) scales, dynamic FP4
        # inputs in groups of 32 (the OCP MX preset)
        "mxfp4": (lambda: [QuantizationModifier(targets="Linear", scheme="MXFP4", ignore=ignore)], False),
        "mxfp4a16": (lambda: [QuantizationModifier(targets="Linear", scheme="MXFP4A16", ignore=ignore)], False),
        # SpinQuant's Hadamard rotations (R1 residual and R2 per head fused into the weights,
        # R4 before down_proj left for run time), then INT8 weights per channel and dynamic
        # INT8 inputs per token (the W8A8 preset). Widths must be powers of two (tiny Qwen3).
        "w8a8_int8_spinquant": (lambda: [
            SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_type="hadamard"),
            QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)], False),
        # with R3 too: a Hadamard per head on queries and keys after RoPE, at run time
        "w8a8_int8_spinquant_r3": (lambda: [
            SpinQuantModifier(rotations=["R1", "R2", "R3", "R4"], transform_type="hadamard"),
            QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)], False),
        # the same with seeded random Hadamard matrices
        "w8a8_int8_spinquant_random": (lambda: [
            SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_type="random-hadamard"),
            QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)], False),
    }


def _calibration(tokenizer, path: Path | None, n: int, max_len: int):
    """n GSM8K questions with their answers, chat-formatted (or synthetic arithmetic
    lines when no file is given), tokenized."""
    from datasets import Dataset

    texts = []
    if path is not None and path.is_file():
        for line in path.read_text().splitlines()[:n]:
            rec = json.loads(line)
            msgs = [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
            texts.append(tokenizer.apply_chat_template(msgs, tokenize=False))
    while len(texts) < n:
        i = len(texts)
        texts.append(f"Question: what is {i} + {2 * i + 3}? Answer: {3 * i + 3}.")
    ids = [tokenizer(t, truncation=True, max_length=max_len, add_special_tokens=False)["input_ids"] for t in texts]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


def make(model_dir: Path, out: Path, scheme: str, calib, recipes, with_oracle: bool = False) -> dict:
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    modifiers, needs_data = recipes[scheme]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    kwargs = {"dataset": calib, "num_calibration_samples": len(calib)} if needs_data else {}
    oneshot(model=model, recipe=modifiers(), **kwargs)
    seconds = time.perf_counter() - t0
    target = out / scheme
    oracle = None
    if with_oracle or any(n.endswith("_input") for n, _ in model.named_modules()):
        # Run-time transforms: transformers' loader drops them (it reports their matrices as
        # unexpected keys), so the oracle is this in-memory model, before it is compressed.
        # --oracle: the same for any scheme (a Mixture-of-Experts model, whose experts
        # llm-compressor linearized, which transformers' loader would fuse again).
        from oracle_outputs import oracle_outputs
        from safetensors.torch import save_file

        oracle = oracle_outputs(model.eval(), tokenizer)
    model.save_pretrained(target, save_compressed=True)
    tokenizer.save_pretrained(target)
    if oracle is not None:
        save_file(oracle, str(target / "oracle.safetensors"))
    return {"scheme": scheme, "seconds": round(seconds, 1), "calibration_samples": len(calib) if needs_data else 0,
            "quantization_config": json.loads((target / "config.json").read_text()).get("quantization_config")}


def main() -> None:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from transformers import AutoTokenizer

    recipes = _recipes()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", default=",".join(recipes))
    parser.add_argument("--calib-jsonl", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--oracle", action="store_true",
                        help="write every scheme's oracle.safetensors (the in-memory quantized model's outputs)")
    args = parser.parse_args()
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in recipes]
    if unknown:
        raise SystemExit(f"error: --schemes: unknown {unknown[0]!r}; allowed: {', '.join(recipes)}")
    torch.manual_seed(0)
    calib = _calibration(AutoTokenizer.from_pretrained(args.model), args.calib_jsonl, args.calib_samples, args.max_len)
    made = {"tool": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
            "model": str(args.model), "calibration": str(args.calib_jsonl), "checkpoints": []}
    for scheme in schemes:
        made["checkpoints"].append(make(args.model, args.out, scheme, calib, recipes, args.oracle))
        print(f"{scheme}: {made['checkpoints'][-1]['seconds']} s -> {args.out / scheme}")
    (args.out / "made.json").write_text(json.dumps(made, indent=2))


if __name__ == "__main__":
    main()
