"""msModelSlim checkpoints ("ascendV1" layout) made by msModelSlim itself, on this CPU, for
specft's quant=checkpoint tests. msModelSlim pins its own packages, so it runs in a venv
of its own (docs/checkpoints.md):

    python -m venv /work/venv-msms && /work/venv-msms/bin/pip install torch==2.13.0 && \\
        /work/venv-msms/bin/pip install msmodelslim==26.1.0 transformers
    /work/venv-msms/bin/python scripts/make_msmodelslim_checkpoints.py --model DIR --out OUT \\
        --recipes w8a8_dynamic,w8a8_static,w4a8_dynamic,w8a8_dynamic_quarot
    # SmolLM2 (Llama layout, tied embeddings) through the same adapter, untied for QuaRot:
    /work/venv-msms/bin/python scripts/make_msmodelslim_checkpoints.py --model $SPECFT_HOME/models/smollm2_135m \\
        --out ckpts/smollm2_msms --recipes w8a8_dynamic_quarot --untie

Each recipe is a modelslim_v1 YAML under scripts/msmodelslim_recipes/ (W8A8 with
IterSmooth and dynamic per-token activations; W8A8 with a static per-tensor activation
scale and offset from msModelSlim's default calibration set; W4A8 with INT4 weights per
channel and dynamic per-token INT8 activations; and W8A8 dynamic after msModelSlim's
offline QuaRot, which rotates by Hadamard matrices and saves R1). OUT/<recipe>/ gets the
checkpoint; OUT/made.json records the tool version, the recipes and the times. Then
`scripts/msmodelslim_oracle.py OUT/*` writes the oracle's outputs beside each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "msmodelslim_recipes"


def main() -> None:
    known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipes", default="w8a8_dynamic,w8a8_static,w4a8_dynamic,w8a8_dynamic_quarot")
    parser.add_argument("--model-type", default="Qwen3-8B", help="msModelSlim's adapter for the architecture")
    parser.add_argument("--untie", action="store_true",
                        help="quantize an untied copy of a model with tied embeddings (OUT/untied-model): msModelSlim's "
                             "QuaRot rotates a tied matrix twice")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in known]
    if unknown:
        raise SystemExit(f"error: --recipes: unknown {unknown[0]!r}; allowed: {', '.join(known)}")
    model = untied_copy(args.model, args.out / "untied-model") if args.untie else args.model
    cli = Path(sys.executable).parent / "msmodelslim"
    tool = {"msmodelslim": version("msmodelslim"), "torch": version("torch"), "transformers": version("transformers")}
    made = {"tool": tool, "model": str(args.model), "untied": args.untie, "checkpoints": []}
    if (args.out / "made.json").is_file():  # add to (or replace in) what an earlier run made with the same tools
        earlier = json.loads((args.out / "made.json").read_text())
        if earlier["tool"] == tool and earlier.get("untied", False) == args.untie:
            made["checkpoints"] = [c for c in earlier["checkpoints"] if c["recipe"] not in recipes]
    for recipe in recipes:
        t0 = time.perf_counter()
        subprocess.run([str(cli), "quant", "--model_type", args.model_type, "--model_path", str(model),
                        "--save_path", str(args.out / recipe), "--device", "cpu",
                        "--config_path", str(RECIPES / f"{recipe}.yaml"), "--trust_remote_code", "False"], check=True)
        made["checkpoints"].append({"recipe": recipe, "seconds": round(time.perf_counter() - t0, 1),
                                    "yaml": (RECIPES / f"{recipe}.yaml").read_text()})
        print(f"{recipe}: {made['checkpoints'][-1]['seconds']} s -> {args.out / recipe}")
    (args.out / "made.json").write_text(json.dumps(made, indent=2))


def untied_copy(model_dir: Path, out: Path) -> Path:
    """The model saved with its own lm_head (a copy of the embedding) and
    tie_word_embeddings false: the same function, two matrices a rotation may treat apart."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    if (model_dir / "chat_template.jinja").is_file():
        shutil.copyfile(model_dir / "chat_template.jinja", out / "chat_template.jinja")
    return out


if __name__ == "__main__":
    main()
