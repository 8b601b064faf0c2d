"""How far is specft's RTN emulation of a format from a real calibrated checkpoint of it?

For each checkpoint (model=hf model.path=DIR quant=checkpoint) and the emulated config of
its nominal format on the 16-bit model (model=smollm2_135m quant=... with overrides), on
the same teacher-forced token sequences: the relative error between their hidden states
(the draft's inputs: the 3 aux layers and the final one), and how often their next-token
choices (top-1) agree, each against the 16-bit model too. A draft trained on one target
and served beside another sees exactly these differences.

    python scripts/checks/checkpoint_distance.py \\
        --pair 'ckpts/smollm2/w4a16_g32_gptq=w4a16;quant.weight.block_size=32' \\
        --pair 'ckpts/smollm2/w8a8_int8_sq_gptq=w8a8_int8' --out docs/results/checkpoints/distance
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specft.cli import compose
from specft.commands.validate import to_schema
from specft.config import aux_layer_ids
from specft.quant import apply_quant, calibrate
from specft.target_model import FeatureCapture, load_target

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def _root(overrides: list[str]):
    cfg = compose([*overrides, "model.dtype=float32"])
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    return to_schema(cfg)


def _target(overrides: list[str], calib: list[torch.Tensor]):
    root = _root(overrides)
    model, tokenizer = load_target(root.model)
    report = apply_quant(model, root.quant)
    if root.quant.needs_calibration:
        calibrate(model, report, ({"input_ids": x[None]} for x in calib[: root.quant.calibration_samples]))
    return model.eval(), tokenizer, aux_layer_ids(root.model)


def sequences(tokenizer, n: int, gsm8k: Path) -> list[torch.Tensor]:
    """GSM8K train questions with their reference answers, chat-formatted (the last n
    lines, away from the first ones the checkpoints were calibrated on)."""
    lines = gsm8k.read_text().splitlines()[-n:]
    out = []
    for line in lines:
        rec = json.loads(line)
        msgs = [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
        out.append(torch.tensor(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)[:384]))
    return out


@torch.no_grad()
def features(model, ids: list[int], seqs: list[torch.Tensor]):
    capture = FeatureCapture(model, ids)
    rows = []
    for x in seqs:
        aux, final = capture(x[None], torch.ones_like(x)[None])
        logits = model.get_output_embeddings()(final)
        rows.append((aux[0].double(), final[0].double(), logits[0].argmax(-1)))
    return rows


def distance(a, b) -> dict:
    """Relative errors (||a-b|| / ||b|| per token, averaged) and top-1 agreement."""
    def rel(x, y):
        return float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).mean())

    aux = sum(rel(x[0], y[0]) for x, y in zip(a, b)) / len(a)
    final = sum(rel(x[1], y[1]) for x, y in zip(a, b)) / len(a)
    agree = sum(int((x[2] == y[2]).sum()) for x, y in zip(a, b))
    total = sum(x[2].numel() for x in a)
    return {"aux_rel_err": aux, "final_rel_err": final, "top1_agreement": agree / total, "tokens": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", action="append", required=True,
                   help="CHECKPOINT_DIR=QUANT[;override...]: a checkpoint and the emulation of its format")
    p.add_argument("--base-model", default="smollm2_135m")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--gsm8k", type=Path, default=SHARED / "gsm8k" / "train.jsonl")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    base, tokenizer, ids = _target([f"model={args.base_model}", "quant=bf16"], [])
    seqs = sequences(tokenizer, args.sequences, args.gsm8k)
    ref = features(base, ids, seqs)
    del base
    rows = []
    for pair in args.pair:
        ckpt_dir, _, emulated = pair.partition("=")
        quant, *overrides = emulated.split(";")
        ckpt = features(_target(["model=hf", f"model.path={Path(ckpt_dir).resolve()}", "quant=checkpoint"], seqs)[0],
                        ids, seqs)
        emul = features(_target([f"model={args.base_model}", f"quant={quant}", *overrides], seqs)[0], ids, seqs)
        rows.append({"checkpoint": Path(ckpt_dir).name, "emulation": emulated,
                     "emulation_vs_checkpoint": distance(emul, ckpt), "bf16_vs_checkpoint": distance(ref, ckpt),
                     "bf16_vs_emulation": distance(ref, emul)})
    lines = ["| checkpoint | emulation | pair | aux hidden rel. err | final hidden rel. err | top-1 agreement |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for pair in ("bf16_vs_checkpoint", "bf16_vs_emulation", "emulation_vs_checkpoint"):
            d = r[pair]
            lines.append(f"| {r['checkpoint']} | {r['emulation']} | {pair.replace('_', ' ')} | {d['aux_rel_err']:.4f} "
                         "| "
                         f"{d['final_rel_err']:.4f} | {d['top1_agreement']:.4f} ({d['tokens']} tokens) |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "dtype": "float32", "sequences": args.sequences}
        (args.out / "distance.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
        (args.out / "distance.md").write_text(table + f"\n\n{machine}\n")


if __name__ == "__main__":
    main()
