"""Issue 15, part 5: token acceptance at k=3 against the target tokens a draft trained on,
the usual recipe (a draft trained on the 16-bit target) against specft's (trained on the
quantized target), on held-out GSM8K, with 95% CIs and the paired difference per budget.

    python scripts/studies/learning_curve.py --out-dir runs/learning_curve                 # MXFP4
    python scripts/studies/learning_curve.py --out-dir runs/learning_curve --quants mxfp4,fp8

Each budget is one `scripts/studies/quant_alignment.py` experiment (GSM8K train only, regenerated
by each target; training steps grow with the data, so every budget sees the same number of
epochs) under <out-dir>/budget-<samples>, its caches under <out-dir>/cache: one root, so a
budget reuses the answers the smaller ones regenerated (data.regenerate.reuse). --regen-fraction 0 trains every
draft (the 16-bit recipe's too) on the reference solutions as written instead, with the
loss on each target's distribution over them (issue 34's fixed text); a fraction between
mixes the two. Tokens are counted apart: those the target wrote and those kept as written.

The 80% question: a line fitted to acceptance against log10(answer tokens) over each
draft's budgets gives the tokens that line would need for 45% and for 80% (curve.md). Every step resumes, so a
stopped run loses at most the step it was in. curve.md, curve.json and curve.png are
rewritten after each budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from data_per_hour import answer_tokens
from steps import difference_cell, find_comparison, rate_cell

SCRIPTS = Path(__file__).resolve().parent


def budget_args(a: argparse.Namespace, samples: int) -> list[str]:
    steps = max(a.min_steps, round(samples * a.steps_per_sample))
    parts = ["base"] + [f"{q}-ours" for q in a.quants.split(",")] + [f"{q}-eval" for q in a.quants.split(",")]
    return [sys.executable, str(SCRIPTS / "quant_alignment.py"), "--out-dir", str(a.out_dir / f"budget-{samples}"),
            "--parts", ",".join(parts), "--qat-quants", "", "--gsm8k-samples", str(samples), "--sharegpt-samples", "0",
            "--steps", str(steps), "--save-every", str(a.save_every), "--eval-prompts", str(a.eval_prompts),
            "--val-samples", str(a.val_samples), "--eval-sets", "gsm8k", "--k", "3", "--batch-sizes", str(a.batch),
            "--latency-k", "", "--vocab-size", str(a.vocab_size), "--vocab-fill", "prior",
            "--regen-batch", str(a.regen_batch), "--eval-tokens", str(a.eval_tokens), "--no-eval-alone",
            "--seed", str(a.seed), "--cache-root", str(cache_root(a, samples)),
            *(["--regen-fraction", str(a.regen_fraction)] if a.regen_fraction is not None else [])]


def cache_root(a: argparse.Namespace, samples: int) -> Path:
    """The curve's caches, or those of the curve --cache-from names (same data). One root
    for every budget, so a larger budget reuses the answers a smaller one regenerated
    (data.regenerate.reuse); a curve begun when each budget had its own root keeps it."""
    base = a.cache_from or a.out_dir
    own = base / f"budget-{samples}" / "cache"
    return own if own.is_dir() else base / "cache"


def tokens(a: argparse.Namespace, samples: int, run: str) -> dict:
    """The answer tokens a budget's draft trained on, regenerated and fixed apart."""
    run_dir = a.out_dir / f"budget-{samples}" / run
    return answer_tokens(run_dir) if (run_dir / "config.yaml").exists() else {}


def collect(a: argparse.Namespace) -> list[dict]:
    rows = []
    for samples in sorted(a.budgets):
        for quant in a.quants.split(","):
            res = a.out_dir / f"budget-{samples}" / f"eval-{quant}-gsm8k-b{a.batch}" / "results.json"
            if not res.exists():
                continue
            report = json.loads(res.read_text())
            by = {r["draft"]: _summary(r) for r in report["results"] if r["k"] == 3}
            rows.append({"samples": samples, "quant": quant, "prompts": report["meta"].get("prompts"),
                         "specft_tokens": tokens(a, samples, f"ours-{quant}"),
                         "baseline_tokens": tokens(a, samples, "base-bf16"),
                         "baseline": by.get("baseline_16bit"), "specft": by.get("specft"),
                         "difference": find_comparison(report.get("comparisons", []), 3, a.batch)})
    return rows


def _summary(r: dict) -> dict:
    """An eval record without its per-prompt counts."""
    return {key: r.get(key) for key in ("acceptance_rate", "acceptance_rate_ci", "acceptance_length")}


def _token_cell(t: dict) -> str:
    return f"{t.get('regenerated_tokens', 0):,} / {t.get('fixed_tokens', 0):,}" if t else ""


def projection(rows: list[dict], draft: str, quant: str, goals=(0.45, 0.80)) -> dict | None:
    """Least-squares line of acceptance rate against log10(answer tokens) over the budgets
    of one draft on one target, and the tokens it would need for each goal; None with
    fewer than two budgets (or a flat or falling line)."""
    import numpy as np

    key = f"{draft}_tokens"
    pts = [(r[key]["answer_tokens"], r[draft]["acceptance_rate"]) for r in rows
           if r["quant"] == quant and r.get(draft) and r.get(key, {}).get("answer_tokens")]
    if len({x for x, _ in pts}) < 2:
        return None
    slope, intercept = np.polyfit(np.log10([x for x, _ in pts]), [y for _, y in pts], 1)
    if slope <= 0:
        return None
    return {"draft": draft, "quant": quant, "budgets": len(pts), "points_per_10x": float(100 * slope),
            "tokens_needed": {f"{g:.2f}": float(10 ** ((g - intercept) / slope)) for g in goals}}


def markdown(rows: list[dict], a: argparse.Namespace) -> str:
    lines = [f"Held-out GSM8K, k=3, batch {a.batch}, greedy; acceptance rate [95% CI over prompts] "
             "(acceptance length). Tokens: answer tokens trained on, regenerated / kept as written.", "",
             "| quant | GSM8K samples | specft tokens | 16-bit recipe tokens | held-out prompts "
             "| baseline (16-bit recipe) | specft | specft - baseline [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [rate_cell(r[d]) if r[d] else "" for d in ("baseline", "specft")]
        lines.append(f"| {r['quant']} | {r['samples']} | {_token_cell(r['specft_tokens'])} | "
                     f"{_token_cell(r['baseline_tokens'])} | {r['prompts']} | {cells[0]} | {cells[1]} | "
                     f"{difference_cell(r['difference']) if r['difference'] else ''} |")
    fits = [f for q in sorted({r["quant"] for r in rows}) for d in ("baseline", "specft") if (f := projection(rows, d,
                                                                                                              q))]
    if fits:
        lines += ["", "A line through acceptance against log10(answer tokens); what it would need (a projection, "
                  "not a measurement):", "", "| quant | draft | budgets | points per 10x tokens | tokens for 45% "
                  "| tokens for 80% |", "|---|---|---|---|---|---|"]
        lines += [f"| {f['quant']} | {f['draft']} | {f['budgets']} | {f['points_per_10x']:.1f} | "
                  f"{f['tokens_needed']['0.45']:,.0f} | {f['tokens_needed']['0.80']:,.0f} |" for f in fits]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for quant in sorted({r["quant"] for r in rows}):
        mine = [r for r in rows if r["quant"] == quant and r["specft"] and r["baseline"]]
        # each draft at the tokens it trained on: the baseline's are the 16-bit target's
        for key, style in (("baseline", "--o"), ("specft", "-s")):
            xs = [r[f"{key}_tokens"].get("answer_tokens") or r["samples"] for r in mine]
            ys = [r[key]["acceptance_rate"] for r in mine]
            err = [[y - r[key]["acceptance_rate_ci"][0] for y, r in zip(ys, mine)],
                   [r[key]["acceptance_rate_ci"][1] - y for y, r in zip(ys, mine)]] \
                if all(r[key]["acceptance_rate_ci"] for r in mine) else None
            ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=f"{key} ({quant} target)")
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens trained on")
    ax.set_ylabel("token acceptance, k=3 (held-out GSM8K)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(rows: list[dict], a: argparse.Namespace) -> None:
    fits = [f for q in sorted({r["quant"] for r in rows}) for d in ("baseline", "specft") if (f := projection(rows, d,
                                                                                                              q))]
    (a.out_dir / "curve.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                      "rows": rows, "projections": fits}, indent=2))
    (a.out_dir / "curve.md").write_text(markdown(rows, a))
    if rows:
        plot(rows, a.out_dir / "curve.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("runs/learning_curve"))
    p.add_argument("--budgets", default="52,520,175", help="GSM8K training samples per budget (~115 new "
                   "tokens each at 128 max), run in this order: the ends of the 10x span first")
    p.add_argument("--quants", default="mxfp4")
    p.add_argument("--steps-per-sample", type=float, default=0.375, help="training steps per sample (a fixed "
                   "number of epochs at every budget)")
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--val-samples", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--regen-batch", type=int, default=32)
    p.add_argument("--regen-fraction", type=float, default=None, help="share of each budget's conversations the "
                   "target answers; 0: the reference solutions as written. Default: all regenerated")
    p.add_argument("--seed", type=int, default=0, help="training seed: a replicate of a curve under another seed")
    p.add_argument("--cache-from", type=Path, default=None, help="another curve's --out-dir whose budget caches "
                   "to reuse (a seed replicate: the caches do not depend on the seed)")
    p.add_argument("--only-summary", action="store_true", help="rewrite curve.* from finished budgets")
    a = p.parse_args()
    a.budgets = [int(b) for b in a.budgets.split(",")]
    a.out_dir = a.out_dir.resolve()
    a.cache_from = a.cache_from.resolve() if a.cache_from else None
    a.out_dir.mkdir(parents=True, exist_ok=True)
    if not a.only_summary:
        for samples in a.budgets:
            subprocess.run(budget_args(a, samples), check=True)
            write(collect(a), a)
    write(collect(a), a)
    print((a.out_dir / "curve.md").read_text())


if __name__ == "__main__":
    main()
