"""How exactly does specft run each GGUF type as llama.cpp runs it? (docs/checkpoints.md's GGUF rows)

For every GGUF given (one model in several llama-quantize types) and the same prompts:
- llama.cpp's greedy continuation (specft-llama-probe: the prompt in one decode, then one
  token per decode, as llama-server decodes alone) against specft's (`quant=checkpoint`,
  greedy through transformers' generate): identical continuations out of N,
  and the first position where they part;
- logits teacher-forced on prompt + llama.cpp's continuation, the whole sequence in one
  decode (llama.cpp's prompt path: its tiled flash-attention kernel for 64 rows or more),
  specft with ggml's activation rounding and, to show the check can fail, without it (the
  same dequantized weights, float activations and KV): max and mean |logit error| and the
  share of rows whose argmax agrees; and the mean error of the hidden states an EAGLE-3
  draft reads (the inputs of the layers after the run's aux_layer_ids, llama.cpp's
  target_layers), as stage 1 caches them.
Prints a table and writes check_gguf_types.json (per-prompt figures included).

    python scripts/checks/check_gguf_types.py --run runs/ours --ggufs f16=smollm2-f16.gguf q4km=smollm2-Q4_K_M.gguf \
        --num-prompts 16 --max-new-tokens 32 data.path=gsm8k/train.jsonl data.split=validation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_vllm import run_config  # noqa: E402


def specft_models(cfg, gguf: Path):
    """(emulated, float) models of one GGUF: quant=checkpoint as specft runs it, and the same
    weights without its run-time rounding."""
    import copy
    import dataclasses

    from specft.quant import apply_quant
    from specft.target_model import load_target

    emulated, tokenizer = load_target(dataclasses.replace(cfg.model, path=str(gguf)), dtype=torch.float32)
    plain = copy.deepcopy(emulated)  # the weights are dequantized once; apply_quant adds the rounding
    apply_quant(emulated, cfg.quant)
    return emulated.eval(), plain.eval(), tokenizer


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_type(cfg, gguf: Path, prompts: list[list[int]], max_new_tokens: int, threads: int,
               taps: tuple[int, ...]) -> dict:
    """``taps``: the layers whose inputs an EAGLE-3 draft reads (llama.cpp's target_layers),
    compared as stage 1 caches them."""
    from specft.llamacpp.probe import run_probe

    theirs = run_probe(gguf, prompts, gen=max_new_tokens, threads=threads).predicted
    full = [p + c for p, c in zip(prompts, theirs)]
    reference = run_probe(gguf, full, layers=taps, ubatch=0, threads=threads)
    emulated, plain, _ = specft_models(cfg, gguf)
    rows = []
    for i, (prompt, cont, ids) in enumerate(zip(prompts, theirs, full)):
        row = {"prompt_tokens": len(prompt), "llamacpp": cont}
        ours = greedy(emulated, prompt, max_new_tokens)
        row.update(specft=ours, first_difference=first_difference(ours, cont))
        for name, model in (("emulated", emulated), ("float", plain)):
            row[name] = compare(model, ids, reference.logits[i], reference.hidden[i], taps)
        rows.append(row)
    summary = {"identical": sum(r["first_difference"] is None for r in rows), "prompts": len(rows)}
    for name in ("emulated", "float"):
        summary[name] = {key: float(np.max([r[name][key] for r in rows]) if key == "max" else
                                    np.mean([r[name][key] for r in rows])) for key in rows[0][name]}
    return {"summary": summary, "per_prompt": rows}


def compare(model, ids: list[int], ref_logits: np.ndarray, ref_hidden: np.ndarray, taps: tuple[int, ...]) -> dict:
    """|specft - llama.cpp| on every row: logits (max, mean, argmax agreement) and the mean
    error of each tapped layer's input."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    ours = out.logits[0].float().numpy()[: len(ref_logits)]
    err = np.abs(ours - ref_logits)
    result = {"max": float(err.max()), "mean": float(err.mean()),
              "argmax_agree": float((ours.argmax(-1) == ref_logits.argmax(-1)).mean())}
    for j, layer in enumerate(taps):  # hidden_states[layer] is layer's input
        result[f"layer{layer}_input_mean"] = float(np.abs(out.hidden_states[layer][0].float().numpy()
                                                         - ref_hidden[:, j]).mean())
    return result


def table(results: dict) -> str:
    taps = [k for k in next(iter(results.values()))["summary"]["emulated"] if k.startswith("layer")]
    lines = ["| GGUF | greedy identical (specft / llama.cpp) | logit error max / mean, ggml rounding | "
             "without it | argmax agreement, with / without | " + " | ".join(
                 f"{t.split('_')[0]} input error, with / without" for t in taps) + " |",
             "|---|---|---|---|---|" + "---|" * len(taps)]
    for name, r in results.items():
        s = r["summary"]
        lines.append(f"| {name} | {s['identical']}/{s['prompts']} | {s['emulated']['max']:.3f} / "
                     f"{s['emulated']['mean']:.4f} | {s['float']['max']:.3f} / {s['float']['mean']:.4f} | "
                     f"{s['emulated']['argmax_agree']:.3f} / {s['float']['argmax_agree']:.3f} | " + " | ".join(
                         f"{s['emulated'][t]:.4f} / {s['float'][t]:.4f}" for t in taps) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a run against one of the GGUFs (its config: model, data)")
    ap.add_argument("--ggufs", nargs="+", required=True, help="NAME=FILE.gguf")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=Path("runs/check_gguf_types"))
    ap.add_argument("overrides", nargs="*", help="fields of the run's config for the prompts")
    args = ap.parse_args()

    from specft.config import aux_layer_ids
    from specft.eval.prompts import load_prompts
    from specft.target_model import load_tokenizer

    cfg = run_config(args.run, [*args.overrides, f"eval.num_prompts={args.num_prompts}",
                                f"eval.max_new_tokens={args.max_new_tokens}"])
    prompts = load_prompts(cfg, load_tokenizer(cfg.model))[0][: args.num_prompts]
    taps = tuple(layer + 1 for layer in aux_layer_ids(cfg.model))  # the tapped layers' outputs: the next inputs
    torch.set_num_threads(args.threads)
    results = {}
    for spec in args.ggufs:
        name, path = spec.split("=", 1)
        results[name] = check_type(cfg, Path(path), prompts, args.max_new_tokens, args.threads, taps)
        print(f"{name}: {results[name]['summary']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "results": results}
    (args.out / "check_gguf_types.json").write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
