"""Issue 31's table: on SmolLM2 with the MXFP4 target, the EAGLE-3 chain, P-EAGLE and
DFlash, each trained on the 16-bit target (the usual recipe) and on the quantized target
(specft), with part 6's recipe and data (scripts/studies/quant_alignment.py: the same caches,
steps and draft vocabulary), all evaluated against the MXFP4 target: acceptance per
position and length at k = 3, 4, 5 with CIs on held-out GSM8K and ShareGPT (batch 16),
ms per token at batch 1 (GSM8K) and 16 against the target alone and the usual recipe,
and memory.

    python scripts/studies/parallel_drafters.py --out-dir runs/parallel --cache-root runs/ckpt_study/cache \\
        --parts eagle3-bf16,eagle3-mxfp4,peagle-bf16,peagle-mxfp4,dflash-bf16,dflash-mxfp4,eval

`<draft>-<quant>` trains one draft (the chain with --ttt-steps TTT steps, the parallel
drafters with one slot per k up to the largest: they draft no further); `eval` evaluates
the six. Every step resumes, as quant_alignment.py's do; <out-dir>/summary.md and
summary.json (per-prompt counts in every row) are rewritten after each eval. A run dir
that already holds the recipe's draft can stand in (a symlink: `eagle3-bf16` is
quant_alignment.py's `base-bf16`).
"""

from __future__ import annotations

import json
from pathlib import Path

from quant_alignment import Experiment, parser, run_parts

from specft.eval.report import verdict
from specft.eval.stats import paired_difference

DRAFTS = ("eagle3", "peagle", "dflash")
# Eval labels: the usual recipe is "baseline_16bit" and specft's chain "specft", so the
# summary's specft-vs-baseline column and latency cut refer to them.
LABELS = {("eagle3", "bf16"): "baseline_16bit", ("eagle3", "target"): "specft"}


def _ci(values) -> str:
    return f" [{values[0]:.3f}, {values[1]:.3f}]" if values else ""


def _pct(value) -> str:
    return "" if value is None else f"{100 * value:+.1f}%"


def drafter_table(rows: list[dict]) -> str:
    """Issue 31's table: per held-out set and k, each draft's acceptance rate and length
    with 95% CIs over prompts, acceptance at each position, ms per token at batch 16 and
    at batch 1 (GSM8K) against the target alone, and memory against the target alone."""
    alone = {(r["data"], r["batch_size"]): r for r in rows if not r["k"]}
    b1 = {(r["draft"], r["k"]): r for r in rows if r["batch_size"] == 1 and r["k"]}
    lines = []
    for data in sorted({r["data"] for r in rows}):
        batch = max(r["batch_size"] for r in rows if r["data"] == data)
        cells = [r for r in rows if r["data"] == data and r["batch_size"] == batch and r["k"]]
        base = alone.get((data, batch))
        lines += [f"**held-out {data}, batch {batch}** (target alone: "
                  f"{base['latency_ms_per_token']:.1f} ms/token)" if base else f"**held-out {data}, batch {batch}**",
                  "", "| draft | k | acceptance rate [95% CI] | acceptance length [95% CI] | at position 1..k "
                  f"| b{batch} ms/token (time cut vs alone) | b1 ms/token on GSM8K (time cut vs alone) | memory vs "
                  "alone |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(cells, key=lambda r: (r["k"], DRAFT_ORDER.get(r["draft"], 99), r["draft"])):
            one = b1.get((r["draft"], r["k"]))
            b1_cell = f"{one['latency_ms_per_token']:.1f} ({_pct(one.get('latency_change_vs_target_alone'))})" \
                if one else ""
            lines.append(f"| {r['draft']} | {r['k']} | {r['acceptance_rate']:.3f}{_ci(r.get('acceptance_rate_ci'))} | "
                         f"{r['acceptance_length']:.2f}{_ci(r.get('acceptance_length_ci'))} | "
                         + " / ".join(f"{a:.2f}" for a in r.get("acceptance_at", [])) + " | "
                         f"{r['latency_ms_per_token']:.1f} ({_pct(r.get('latency_change_vs_target_alone'))}) | "
                         f"{b1_cell} | {_pct(r.get('memory_vs_target_alone'))} |")
        lines.append("")
    return "\n".join(lines)


# Each drafter trained on the 16-bit target (a) against the same drafter trained on the
# quantized target (b): the pairs whose difference is specft's gain per drafter.
PAIRS = (("baseline_16bit", "specft"), ("peagle_16bit", "specft_peagle"), ("dflash_16bit", "specft_dflash"))


def gain_table(rows: list[dict], seed: int = 0) -> str:
    """Per drafter, held-out set and k: the quant-aware draft minus the same drafter trained
    on the 16-bit target, in acceptance rate (points) and length, paired over the same prompts."""
    cells = {(r["data"], r["batch_size"], r["draft"], r["k"]): r for r in rows if r["k"]}
    lines = ["| held-out set | k | drafter | trained on target minus on bf16: rate [95% CI] | length [95% CI] |",
             "|---|---|---|---|---|"]
    for data, batch, k in sorted({(d, b, k) for d, b, _, k in cells}):
        for a, b in PAIRS:
            ra, rb = cells.get((data, batch, a, k)), cells.get((data, batch, b, k))
            if not (ra and rb and ra.get("per_prompt") and rb.get("per_prompt")):
                continue
            diff = paired_difference(ra["per_prompt"], rb["per_prompt"], seed)
            lo, hi = diff["rate_difference_ci"]
            llo, lhi = diff["length_difference_ci"]
            lines.append(f"| {data} b{batch} | {k} | {b} - {a} | {100 * diff['rate_difference']:+.1f} pts "
                         f"[{100 * lo:+.1f}, {100 * hi:+.1f}], {verdict({**diff, 'a': a, 'b': b})} | "
                         f"{diff['length_difference']:+.2f} "
                         f"[{llo:+.2f}, {lhi:+.2f}] |")
    return "\n".join(lines)


# Table order: the usual recipe first, then specft's chain, then the parallel drafters.
DRAFT_ORDER = {"baseline_16bit": 0, "specft": 1, "peagle_16bit": 2, "specft_peagle": 3, "dflash_16bit": 4,
               "specft_dflash": 5}


class ParallelDrafters(Experiment):
    def run_dir(self, draft: str, quant: str) -> Path:
        return self.out / f"{draft}-{quant}"

    def label(self, draft: str, quant: str) -> str:
        trained_on = "bf16" if quant == "bf16" else "target"
        return LABELS.get((draft, trained_on), f"{draft}_16bit" if quant == "bf16" else f"specft_{draft}")

    def summarize(self) -> None:
        super().summarize()
        summary = json.loads((self.out / "summary.json").read_text())
        table = drafter_table(summary["rows"])
        gains = gain_table(summary["rows"], self.args.seed)
        (self.out / "drafters.md").write_text(table + "\n" + gains + "\n")

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
                   eval_sets="gsm8k,sharegpt",
                   parts="eagle3-bf16,eagle3-mxfp4,peagle-bf16,peagle-mxfp4,dflash-bf16,dflash-mxfp4,eval")
    args = p.parse_args()
    exp = ParallelDrafters(args)
    run_parts(exp, args, Path(__file__))
    exp.summarize()
    print((exp.out / "summary.md").read_text())
    print((exp.out / "drafters.md").read_text())


if __name__ == "__main__":
    main()
