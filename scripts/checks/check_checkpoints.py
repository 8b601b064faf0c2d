"""specft's quant=checkpoint target against the producing library's own forward.

For each quantized checkpoint directory: the model specft runs (its own dequantization
and run-time input quantization, specft/quantized_checkpoints/) and the oracle, the
model transformers builds with compressed-tensors decompressing the checkpoint and
quantizing activations in its forward hooks. Where transformers cannot load a checkpoint
(it refuses the packed zero points of an asymmetric pack-quantized one), the oracle is a
plain model whose weights compressed-tensors' own compressor decompressed (those
checkpoints quantize no activations, so the forward is the library's). Both run in
float32 on the same prompts; the table gives the relative error of every decoder layer's
output and of the logits, and how many prompts' greedy continuations are identical.

    python scripts/checks/check_checkpoints.py tests/fixtures/checkpoints/tiny_qwen3/* --out docs/results/checkpoints
    python scripts/checks/check_checkpoints.py tests/fixtures/checkpoints/tiny_qwen3_hf_fp8 \
        --oracle-dir tests/fixtures/checkpoints/tiny_qwen3/fp8_block --out docs/results/checkpoints/hf_fp8
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def specft_model(model_dir: Path, quant: str = "checkpoint", *overrides: str):
    """(model, tokenizer) as specft runs the target, float32 unless ``overrides`` say otherwise."""
    from omegaconf import OmegaConf

    from specft.cli import compose
    from specft.commands.validate import to_schema
    from specft.quant import apply_quant
    from specft.target_model import load_target

    cfg = compose(["model=hf", f"model.path={model_dir}", f"quant={quant}", "model.dtype=float32", *overrides])
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    root = to_schema(cfg)
    model, tokenizer = load_target(root.model)
    apply_quant(model, root.quant)
    return model.eval(), tokenizer


def oracle_model(model_dir: Path):
    """(model, how it was built)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except RuntimeError:  # e.g. packed zero points transformers does not size
        return _decompressed_plain(model_dir), "compressed-tensors decompressor, plain forward"
    # The library decompresses on the first forward (a pre-hook), FP4 weights to bfloat16
    # whatever dtype it was asked for: a hook after its own brings them to float32.
    model.register_forward_pre_hook(_bfloat16_params_to_float32)
    return model.eval(), "transformers + compressed-tensors forward"


def _bfloat16_params_to_float32(model, args):
    for param in model.parameters():
        if param.dtype == torch.bfloat16:
            param.data = param.data.float()


def _decompressed_plain(model_dir: Path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    qcfg = config.quantization_config
    qcfg = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
    if any(g.get("input_activations") for g in qcfg["config_groups"].values()):
        raise SystemExit(f"error: {model_dir}: transformers cannot load it and it quantizes activations: no oracle")
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    raw = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    (group,) = qcfg["config_groups"].values()
    compressor = BaseCompressor.get_value_from_registry(qcfg["format"])
    scheme = QuantizationScheme(**group)
    state = {k: v for k, v in raw.items() if k.rsplit(".", 1)[-1] in ("weight", "bias") or "norm" in k}
    for prefix in sorted({k.rsplit(".", 1)[0] for k in raw if k.endswith(".weight_scale")}):
        local = {k[len(prefix) + 1:]: v for k, v in raw.items() if k.startswith(prefix + ".")}
        state[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"]
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a-b| / max |b|, mean |a-b| / mean |b|)."""
    d = (a.double() - b.double()).abs()
    return float(d.max() / b.double().abs().max()), float(d.mean() / b.double().abs().mean())


def prompts(tokenizer, n: int) -> list[list[int]]:
    questions = [f"What is {i * 7 + 3} plus {i * 11 + 5}? Explain step by step." for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in questions]


@torch.no_grad()
def compare(model_dir: Path, n_prompts: int, new_tokens: int, oracle_dir: Path | None = None) -> dict:
    """``oracle_dir``: the library's checkpoint the oracle runs, when ``model_dir`` holds the
    same tensors in another family's layout (the HF FP8 fixture, renamed from FP8_BLOCK)."""
    ours, tokenizer = specft_model(model_dir)
    oracle, how = oracle_model(oracle_dir or model_dir)
    worst_hidden, mean_hidden, worst_logits, mean_logits, identical = 0.0, [], 0.0, [], 0
    for ids in prompts(tokenizer, n_prompts):
        x = torch.tensor([ids])
        a = ours(x, output_hidden_states=True)
        b = oracle(x, output_hidden_states=True)
        for ha, hb in zip(a.hidden_states[1:], b.hidden_states[1:]):
            mx, mn = _rel(ha, hb)
            worst_hidden, mean_hidden = max(worst_hidden, mx), mean_hidden + [mn]
        mx, mn = _rel(a.logits, b.logits)
        worst_logits, mean_logits = max(worst_logits, mx), mean_logits + [mn]
        ga = ours.generate(x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        gb = oracle.generate(x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        identical += int(torch.equal(ga, gb))
    qcfg = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    return {"checkpoint": model_dir.name, "format": qcfg.get("format", qcfg["quant_method"]),
            "summary": ours.specft_checkpoint.summary,
            "oracle": how, "hidden_rel_err_max": worst_hidden,
            "hidden_rel_err_mean": sum(mean_hidden) / len(mean_hidden),
            "logits_rel_err_max": worst_logits, "logits_rel_err_mean": sum(mean_logits) / len(mean_logits),
            "greedy_identical": identical, "prompts": n_prompts, "new_tokens": new_tokens}


def main() -> None:
    import compressed_tensors
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--oracle-dir", type=Path, help="the library's checkpoint holding the same tensors in its "
                        "own layout (the HF FP8 fixture: its FP8_BLOCK source)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [compare(d, args.prompts, args.new_tokens, args.oracle_dir) for d in args.dirs
            if (d / "config.json").is_file()]
    machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
               "transformers": transformers.__version__, "compressed_tensors": compressed_tensors.__version__,
               "threads": torch.get_num_threads()}
    lines = ["| checkpoint | format | scheme | oracle | hidden rel. err max / mean | logits rel. err max / mean "
             "| greedy identical |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {r['format']} | {r['summary'].split(': ', 1)[-1]} | {r['oracle']} | "
                     f"{r['hidden_rel_err_max']:.1e} / {r['hidden_rel_err_mean']:.1e} | "
                     f"{r['logits_rel_err_max']:.1e} / {r['logits_rel_err_mean']:.1e} | "
                     f"{r['greedy_identical']}/{r['prompts']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "agreement.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
        (args.out / "agreement.md").write_text(f"{table}\n\nfloat32; {machine}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
