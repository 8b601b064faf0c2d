"""Which quantized checkpoints vLLM's CPU path serves, and whether it serves the model
specft runs (quant=checkpoint).

For each checkpoint directory: specft's model (its dequantization and run-time input
quantization) decodes N chat prompts greedily; vLLM (its own venv, scripts/checks/vllm_worker.py,
target alone) decodes the same prompt ids. The table says whether vLLM loaded and ran
the checkpoint (else its error line), how many of the N continuations are identical, and
how often a continuation first differs per compared token. An unquantized model among
the directories gives the two engines' agreement without any quantization. vLLM's CPU
attention needs head_dim 32, 64, ... (the tests'
tiny Qwen3 has 16: make the checkpoints from `model=tiny_qwen3 model.head_dim=32`).

    python scripts/checks/check_vllm_checkpoints.py CKPT_DIR... --vllm-python ../vllm-venv/bin/python \
        --dtype bfloat16 --out docs/results/checkpoints/vllm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_checkpoints import prompts, specft_model  # noqa: E402
from check_vllm import vllm_side  # noqa: E402

from specft.eval.runner import divergence  # noqa: E402

WRAPPERS = ("EngineDead", "encountered", "Worker failed", "initialization failed")


def first_error(log: Path) -> str:
    """The root-cause line of a failed vLLM start: the first error line that is not one of
    the engine's wrappers around it."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Error:" in ln]
    causes = [ln for ln in lines if not any(w in ln for w in WRAPPERS)] or lines
    return causes[0].split("] ")[-1].strip()[:300] if causes else "failed (no error line in the log)"


@torch.no_grad()
def specft_tokens(model_dir: Path, n: int, new_tokens: int, dtype: torch.dtype) -> tuple[list, list]:
    from specft.quantized_checkpoints import open_checkpoint

    # an unquantized model too: how far the two engines agree with no quantization at all
    model, tokenizer = specft_model(model_dir, "checkpoint" if open_checkpoint(model_dir) else "bf16")
    model = model.to(dtype)
    ids = prompts(tokenizer, n)
    out = []
    for p in ids:
        g = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
        out.append(g[0, len(p):].tolist())
    return ids, out


def check(model_dir: Path, args) -> dict:
    ids, ours = specft_tokens(model_dir, args.prompts, args.new_tokens, getattr(torch, args.dtype))
    work = args.work / model_dir.name  # vLLM's request, result and log
    work.mkdir(parents=True, exist_ok=True)
    request = {"target": str(model_dir), "draft": None, "prompts": ids, "ks": [],
               "max_new_tokens": args.new_tokens, "dtype": args.dtype, "target_alone": True}
    row = {"checkpoint": model_dir.name, "dtype": args.dtype, "prompts": len(ids)}
    try:
        theirs = vllm_side(args.vllm_python, request, work)["runs"][0]["tokens"]
    except SystemExit:
        return {**row, "vllm_runs": False, "error": first_error(work / "vllm_log.txt")}
    return {**row, "vllm_runs": True, "identical": sum(a == b for a, b in zip(ours, theirs)),
            "divergence": divergence(ours, theirs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "../vllm-venv/bin/python"))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "specft-vllm-checkpoints",
                    help="where vLLM's requests, results and logs go")
    args = ap.parse_args()
    args.out, args.work = args.out.resolve(), args.work.resolve()  # vLLM runs in the work folder
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [check(d.resolve(), args) for d in args.dirs if (d / "config.json").is_file()]
    lines = ["| checkpoint | vLLM CPU runs it | identical greedy continuations, specft vs vLLM (flips per compared "
             "token) |",
             "|---|---|---|"]
    for r in rows:
        if r["vllm_runs"]:
            lines.append(f"| {r['checkpoint']} | yes | {r['identical']}/{r['prompts']} "
                         f"({r['divergence']['flip_rate']:.1%}) |")
        else:
            lines.append(f"| {r['checkpoint']} | no: `{r['error']}` | |")
    table = "\n".join(lines)
    print(table)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.dtype}"
    (args.out / "vllm.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    (args.out / "vllm.md").write_text(f"{table}\n\n{machine}\n")


if __name__ == "__main__":
    main()
