"""specft's quant=checkpoint target against a stored oracle (``oracle.safetensors``: what
the producing tool's own model computed, scripts/oracle_outputs.py), for checkpoints whose
tool does not run in specft's venv (GPTQModel, AutoRound, ModelOpt).

Per checkpoint: the relative error of every decoder layer's output and of the last logits
(max over elements of |a - b| / max |b|, and mean |a - b| / mean |b|), whether each
quantized layer's dequantized weight is bit-equal to the tool's (where the oracle stores
``dequantized.<layer>``), and how many prompts' greedy continuations are identical.

    python scripts/check_oracle_outputs.py tests/fixtures/checkpoints/tiny_qwen3_gptq_awq/* \\
        --dtype float16 --out docs/results/checkpoints/gptq_awq
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from check_checkpoints import _rel, specft_model
from safetensors import safe_open
from safetensors.torch import load_file


def dense_weight(state: dict, layer: str) -> torch.Tensor:
    """A layer's weight in specft's model; per-expert layers out of transformers' fused
    experts (gate_up_proj [E, 2I, H]: gate rows, then up rows; down_proj [E, H, I])."""
    if f"{layer}.weight" in state:
        return state[f"{layer}.weight"]
    experts, index, proj = layer.rsplit(".", 2)
    if proj == "down_proj":
        return state[f"{experts}.down_proj"][int(index)]
    fused = state[f"{experts}.gate_up_proj"][int(index)]
    half = fused.shape[0] // 2
    return fused[:half] if proj == "gate_proj" else fused[half:]


@torch.no_grad()
def compare(model_dir: Path, dtype: str) -> dict:
    oracle = load_file(str(model_dir / "oracle.safetensors"))
    meta = safe_open(str(model_dir / "oracle.safetensors"), "pt").metadata() or {}
    model, tokenizer = specft_model(model_dir, "checkpoint", f"model.dtype={dtype}", "eval.dtype=float32")
    ids = oracle["input_ids"]
    out = model(ids, output_hidden_states=True)
    hidden = [_rel(h, oracle[f"hidden.{i}"]) for i, h in enumerate(out.hidden_states[1:])]
    logits = _rel(out.logits[:, -oracle["logits"].shape[1]:], oracle["logits"])
    new = oracle["greedy"].shape[1] - ids.shape[1]
    greedy = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    state = model.state_dict()
    layers = [k[len("dequantized."):] for k in oracle if k.startswith("dequantized.")]
    equal = sum(torch.equal(dense_weight(state, n), oracle[f"dequantized.{n}"]) for n in layers)
    return {"checkpoint": model_dir.name, "summary": model.specft_checkpoint.summary, "dtype": dtype,
            "oracle": meta, "weights_bit_equal": f"{equal}/{len(layers)}" if layers else "-",
            "hidden_rel_err_max": max(h[0] for h in hidden), "hidden_rel_err_mean": sum(h[1] for h in hidden) / len(hidden),
            "logits_rel_err_max": logits[0], "logits_rel_err_mean": logits[1],
            "greedy_identical": int(sum(torch.equal(a, b) for a, b in zip(greedy, oracle["greedy"]))),
            "prompts": int(ids.shape[0]), "new_tokens": int(new)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--dtype", default="float32", help="the oracle's dtype (GPTQModel's torch kernels: float16)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [compare(d, args.dtype) for d in args.dirs if (d / "oracle.safetensors").is_file()]
    lines = ["| checkpoint | scheme | weights bit-equal | hidden rel. err max / mean | logits rel. err max / mean "
             "| greedy identical |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {r['summary']} | {r['weights_bit_equal']} | "
                     f"{r['hidden_rel_err_max']:.1e} / {r['hidden_rel_err_mean']:.1e} | "
                     f"{r['logits_rel_err_max']:.1e} / {r['logits_rel_err_mean']:.1e} | "
                     f"{r['greedy_identical']}/{r['prompts']} ({r['new_tokens']} tokens) |")
    machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "dtype": args.dtype}
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "agreement.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
        (args.out / "agreement.md").write_text(f"{table}\n\n{machine}\n")


if __name__ == "__main__":
    main()
