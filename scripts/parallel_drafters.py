"""Issue 31's table: on SmolLM2 with the MXFP4 target, the EAGLE-3 chain, P-EAGLE and
DFlash, each trained on the 16-bit target (the usual recipe) and on the quantized target
(specft), with part 6's recipe and data (scripts/quant_alignment.py: the same caches,
steps and draft vocabulary), all evaluated against the MXFP4 target: acceptance per
position and length at k = 3, 4, 5 with CIs on held-out GSM8K and ShareGPT (batch 16),
ms per token at batch 1 (GSM8K) and 16 against the target alone and the usual recipe,
and memory.

    python scripts/parallel_drafters.py --out-dir runs/parallel --cache-root runs/ckpt_study/cache \\
        --parts eagle3-bf16,eagle3-mxfp4,peagle-bf16,peagle-mxfp4,dflash-bf16,dflash-mxfp4,eval

`<draft>-<quant>` trains one draft (the chain with --ttt-steps TTT steps, the parallel
drafters with one slot per k up to the largest: they draft no further); `eval` evaluates
the six. Every step resumes, as quant_alignment.py's do; <out-dir>/summary.md and
summary.json (per-prompt counts in every row) are rewritten after each eval. A run dir
that already holds the recipe's draft can stand in (a symlink: `eagle3-bf16` is
quant_alignment.py's `base-bf16`).
"""

from __future__ import annotations

from pathlib import Path

from quant_alignment import Experiment, parser

DRAFTS = ("eagle3", "peagle", "dflash")
# Eval labels: the usual recipe is "baseline_16bit" and specft's chain "specft", so the
# summary's specft-vs-baseline column and latency cut refer to them.
LABELS = {("eagle3", "bf16"): "baseline_16bit", ("eagle3", "target"): "specft"}


class ParallelDrafters(Experiment):
    def run_dir(self, draft: str, quant: str) -> Path:
        return self.out / f"{draft}-{quant}"

    def label(self, draft: str, quant: str) -> str:
        trained_on = "bf16" if quant == "bf16" else "target"
        return LABELS.get((draft, trained_on), f"{draft}_16bit" if quant == "bf16" else f"specft_{draft}")

    def run_part(self, part: str) -> None:
        a = self.args
        if part == "eval":
            drafts = [(self.label(d, q), self.run_dir(d, q)) for d in DRAFTS for q in ("bf16", a.target_quant)]
            self.evaluate(a.target_quant, drafts, alone=a.eval_alone)
            return
        draft, _, quant = part.partition("-")
        if draft not in DRAFTS or quant not in ("bf16", a.target_quant):
            raise SystemExit(f"unknown part {part!r}: <draft>-<quant> (draft {', '.join(DRAFTS)}; quant bf16 or "
                             f"{a.target_quant}) or eval")
        slots = max(int(k) for k in a.k.split(","))
        self.train(f"train {draft} ({quant} target)", quant, self.run_dir(draft, quant), f"draft={draft}",
                   ttt_steps=None if draft == "eagle3" else slots)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--target-quant", default="mxfp4", help="the quantized target the drafts are served with")
    p.set_defaults(out_dir=Path("runs/parallel_drafters"), qat_quants="", latency_prompts=32,
                   parts="eagle3-bf16,eagle3-mxfp4,peagle-bf16,peagle-mxfp4,dflash-bf16,dflash-mxfp4,eval")
    args = p.parse_args()
    exp = ParallelDrafters(args)
    for part in args.parts.split(","):
        if part:
            exp.run_part(part)
    exp.summarize()
    print((exp.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
